//! The LSB-first bit streams a block's codes are packed in: each code's
//! low bit first, codes back to back, zero-padded to a byte
//! (docs/FORMAT.md section 6). Every codec reads and writes its codes
//! through these two.

/// LSB-first bit stream reader. Reading past the end yields zero bits (the
/// callers check lengths first).
pub(super) struct BitReader<'a> {
    data: &'a [u8],
    pos: usize,
    acc: u64,
    have: u32,
}

impl<'a> BitReader<'a> {
    pub(super) fn new(data: &'a [u8]) -> Self {
        BitReader {
            data,
            pos: 0,
            acc: 0,
            have: 0,
        }
    }

    /// A reader positioned `bit` bits into `data` (past the end: reads 0).
    pub(super) fn at(data: &'a [u8], bit: u64) -> Self {
        let byte = usize::try_from(bit / 8).unwrap_or(usize::MAX);
        let mut r = BitReader::new(data.get(byte..).unwrap_or(&[]));
        r.read((bit % 8) as u8);
        r
    }

    #[inline]
    pub(super) fn read(&mut self, w: u8) -> u32 {
        let w = u32::from(w);
        while self.have < w {
            let byte = self.data.get(self.pos).copied().unwrap_or(0);
            self.pos += 1;
            self.acc |= u64::from(byte) << self.have;
            self.have += 8;
        }
        let v = (self.acc & ((1u64 << w) - 1)) as u32;
        self.acc >>= w;
        self.have -= w;
        v
    }
}

/// LSB-first bit stream writer.
#[derive(Default)]
pub struct BitWriter {
    out: Vec<u8>,
    acc: u64,
    have: u32,
}

impl BitWriter {
    pub fn push(&mut self, code: u32, w: u8) {
        let w = u32::from(w);
        if w == 0 {
            return;
        }
        // w <= 16 (MAX_BITS), so the mask and the shift fit in u64.
        self.acc |= (u64::from(code) & ((1u64 << w) - 1)) << self.have;
        self.have += w;
        while self.have >= 8 {
            self.out.push(self.acc as u8);
            self.acc >>= 8;
            self.have -= 8;
        }
    }

    pub fn finish(mut self) -> Vec<u8> {
        if self.have > 0 {
            self.out.push(self.acc as u8);
        }
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bit_stream_round_trip() {
        let widths = [1u8, 16, 3, 0, 7, 8, 13, 2, 16, 5];
        let codes: Vec<u32> = widths
            .iter()
            .enumerate()
            .map(|(i, &w)| {
                if w == 0 {
                    0
                } else {
                    (i as u32).wrapping_mul(2654435761) & ((1 << w) - 1)
                }
            })
            .collect();
        let mut bw = BitWriter::default();
        for (&c, &w) in codes.iter().zip(&widths) {
            bw.push(c, w);
        }
        let bytes = bw.finish();
        let total: u32 = widths.iter().map(|&w| u32::from(w)).sum();
        assert_eq!(bytes.len() as u32, total.div_ceil(8));
        let mut r = BitReader::new(&bytes);
        for (&c, &w) in codes.iter().zip(&widths) {
            if w > 0 {
                assert_eq!(r.read(w), c);
            }
        }
    }

    #[test]
    fn lsb_first_packing_order() {
        // Two 4-bit codes 0x3 then 0xA share one byte: low nibble first.
        let mut bw = BitWriter::default();
        bw.push(0x3, 4);
        bw.push(0xA, 4);
        bw.push(0b1, 1);
        assert_eq!(bw.finish(), vec![0xA3, 0x01]);
    }
}
