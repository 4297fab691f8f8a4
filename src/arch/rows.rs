//! The Q/K row order of llama-like families: llama.cpp's
//! convert_hf_to_gguf.py (`LlamaModel.permute`) interleaves the two rotary
//! halves of each head's rows, Hugging Face keeps them apart. One
//! [`RowGroups`] describes both orders of one tensor; the backend serves a
//! checkpoint's Hugging Face rows in GGUF order, the views and the HF-named
//! files serve GGUF-ordered rows in Hugging Face order, through the same
//! two maps and the same run splitting.

use std::ops::Range;

/// Rows in `groups` groups (heads) of `group_rows` (even) rows of
/// `row_elems` elements. Within a group, GGUF row `2 * i + j` is Hugging
/// Face row `j * group_rows / 2 + i` (j in 0..2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowGroups {
    pub groups: u64,
    pub group_rows: u64,
    pub row_elems: u64,
}

/// The order rows are served in (the other one is the order they are read
/// from).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowOrder {
    /// llama.cpp's converter's order (GGUF names).
    Gguf,
    /// The checkpoint's own order (Hugging Face names).
    Hf,
}

impl RowGroups {
    /// The groups of a tensor of `n_rows` rows and `n_elements` elements in
    /// `groups` heads, or why its shape does not allow them.
    pub fn of_shape(groups: u64, n_rows: u64, n_elements: u64) -> Result<RowGroups, String> {
        if groups == 0 || n_rows == 0 || !n_rows.is_multiple_of(2 * groups) {
            return Err(format!(
                "{n_rows} rows are not a multiple of 2 x {groups} heads"
            ));
        }
        let rows = RowGroups {
            groups,
            group_rows: n_rows / groups,
            row_elems: n_elements / n_rows,
        };
        if !rows.tiles(n_elements) {
            return Err(format!(
                "{n_rows} rows do not divide the tensor's {n_elements} elements"
            ));
        }
        Ok(rows)
    }

    /// Rows of the tensor.
    pub fn rows(&self) -> u64 {
        self.groups.saturating_mul(self.group_rows)
    }

    /// Whether the groups are whole pairs of rows and cover exactly
    /// `n_elements` elements.
    pub fn tiles(&self, n_elements: u64) -> bool {
        self.group_rows >= 2
            && self.group_rows.is_multiple_of(2)
            && self
                .groups
                .checked_mul(self.group_rows)
                .and_then(|r| r.checked_mul(self.row_elems))
                == Some(n_elements)
    }

    /// The Hugging Face row holding GGUF row `r`.
    pub fn hf_row(&self, r: u64) -> u64 {
        let g = self.group_rows.max(2);
        let (head, k) = (r / g, r % g);
        head * g + (k % 2) * (g / 2) + k / 2
    }

    /// The GGUF row holding Hugging Face row `r` (the inverse of
    /// [`Self::hf_row`]).
    pub fn gguf_row(&self, r: u64) -> u64 {
        let g = self.group_rows.max(2);
        let half = g / 2;
        let (head, k) = (r / g, r % g);
        head * g + 2 * (k % half) + k / half
    }

    /// The row read for row `r` served in `order`.
    pub fn source_row(&self, order: RowOrder, r: u64) -> u64 {
        match order {
            RowOrder::Gguf => self.hf_row(r),
            RowOrder::Hf => self.gguf_row(r),
        }
    }

    /// The element read for element `e` served in `order`.
    pub fn source_elem(&self, order: RowOrder, e: u64) -> u64 {
        let re = self.row_elems.max(1);
        self.source_row(order, e / re) * re + e % re
    }

    /// Split `range` of the tensor served in `order`, in units of which a
    /// row holds `row_len` (elements, or bytes of some encoding), into runs
    /// inside one row: (offset of the run from `range.start`, the range
    /// read for it).
    pub fn runs(
        &self,
        order: RowOrder,
        row_len: u64,
        range: Range<u64>,
    ) -> impl Iterator<Item = (u64, Range<u64>)> + '_ {
        let row_len = row_len.max(1);
        let mut pos = range.start;
        std::iter::from_fn(move || {
            if pos >= range.end {
                return None;
            }
            let row = pos / row_len;
            let run_end = (row + 1).saturating_mul(row_len).min(range.end);
            let from = self.source_row(order, row) * row_len + (pos - row * row_len);
            let out = (pos - range.start, from..from + (run_end - pos));
            pos = run_end;
            Some(out)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shapes() -> Vec<RowGroups> {
        // Odd and even head counts and head sizes, one-row-pair heads, one
        // head; a head of 2 * n_rot / 2 rows stands for n_rot < head_dim
        // too: llama.cpp's converter permutes the whole head regardless.
        let mut out = Vec::new();
        for groups in [1, 2, 3, 5] {
            for group_rows in [2, 4, 6, 10, 64] {
                for row_elems in [1, 3] {
                    out.push(RowGroups {
                        groups,
                        group_rows,
                        row_elems,
                    });
                }
            }
        }
        out
    }

    #[test]
    fn the_two_maps_are_inverse_permutations() {
        for p in shapes() {
            let n = p.rows();
            let mut seen = vec![false; n as usize];
            for r in 0..n {
                assert_eq!(p.gguf_row(p.hf_row(r)), r, "{p:?} row {r}");
                assert_eq!(p.hf_row(p.gguf_row(r)), r, "{p:?} row {r}");
                let h = p.hf_row(r);
                assert!(h < n && !seen[h as usize], "{p:?}: row {h} twice");
                seen[h as usize] = true;
                // Rows never leave their group.
                assert_eq!(h / p.group_rows, r / p.group_rows, "{p:?}");
            }
        }
    }

    #[test]
    fn gguf_order_is_the_converters() {
        // convert_hf_to_gguf.py: w.reshape(heads, 2, rows / heads / 2, ...)
        // .swapaxes(1, 2): GGUF row (h, i, j) is HF row (h, j, i).
        for p in shapes() {
            let half = p.group_rows / 2;
            for h in 0..p.groups {
                for i in 0..half {
                    for j in 0..2 {
                        let gguf = h * p.group_rows + 2 * i + j;
                        let hf = h * p.group_rows + j * half + i;
                        assert_eq!(p.hf_row(gguf), hf, "{p:?}");
                        assert_eq!(p.gguf_row(hf), gguf, "{p:?}");
                    }
                }
            }
        }
        // One pair of rows per head: both orders are the same.
        let pair = RowGroups {
            groups: 3,
            group_rows: 2,
            row_elems: 4,
        };
        assert!((0..6).all(|r| pair.hf_row(r) == r && pair.gguf_row(r) == r));
    }

    #[test]
    fn runs_cover_every_unit_once_in_either_order() {
        for p in shapes().into_iter().filter(|p| p.rows() <= 20) {
            for (order, unit) in [(RowOrder::Gguf, 1), (RowOrder::Hf, 4), (RowOrder::Hf, 2)] {
                let row_len = p.row_elems * unit;
                let total = p.rows() * row_len;
                for a in 0..total {
                    for b in [a, a + 1, a + row_len, a + 2 * row_len + 1, total] {
                        let b = b.min(total);
                        let mut got = Vec::new();
                        let mut next = 0;
                        for (at, r) in p.runs(order, row_len, a..b) {
                            assert_eq!(at, next, "{p:?} {a}..{b}: runs in order");
                            assert!(r.end - r.start <= row_len && r.start < r.end);
                            next += r.end - r.start;
                            got.extend(r);
                        }
                        let want: Vec<u64> = (a..b)
                            .map(|x| p.source_row(order, x / row_len) * row_len + x % row_len)
                            .collect();
                        assert_eq!(got, want, "{p:?} {order:?} {a}..{b}");
                    }
                }
            }
        }
        let p = RowGroups {
            groups: 2,
            group_rows: 4,
            row_elems: 3,
        };
        assert_eq!(p.source_elem(RowOrder::Hf, 4), 2 * 3 + 1);
        assert_eq!(p.source_elem(RowOrder::Gguf, 7), 3 + 1);
    }

    #[test]
    fn shapes_that_do_not_tile_are_refused() {
        assert_eq!(
            RowGroups::of_shape(2, 8, 24),
            Ok(RowGroups {
                groups: 2,
                group_rows: 4,
                row_elems: 3
            })
        );
        assert!(RowGroups::of_shape(3, 8, 24).is_err());
        assert!(RowGroups::of_shape(0, 8, 24).is_err());
        assert!(RowGroups::of_shape(2, 0, 0).is_err());
        assert!(RowGroups::of_shape(2, 8, 25).is_err());
        assert!(
            !RowGroups {
                groups: 2,
                group_rows: 3,
                row_elems: 1
            }
            .tiles(6)
        );
        assert!(
            !RowGroups {
                groups: u64::MAX,
                group_rows: 4,
                row_elems: 1
            }
            .tiles(0)
        );
    }
}
