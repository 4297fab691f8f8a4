//! Layered backend: a primary (SK32 or .rknot) over a dense fallback
//! (dense .knot or GGUF).
//!
//! Rules:
//! - a tensor the primary carries is served from the primary, except the
//!   vocab tables (`token_embd.weight`, `output.weight`), which a lossy
//!   primary never serves (seed 000: a rank-32 vocab sketch poisons the
//!   output); they come from the fallback, or are listed unavailable;
//! - everything else comes from the fallback;
//! - a primary tensor whose shape disagrees with the fallback's is an error
//!   at open naming both shapes.

use std::sync::Arc;

use crate::backend::{
    Availability, Backend, Role, SourceSummary, StoredType, TensorInfo, TensorTable,
};
use crate::error::{ErrorKind, Result, err};
use crate::names;
use crate::source::SourceFile;

#[derive(Debug, Clone, Copy)]
enum Route {
    Primary(usize),
    Fallback(usize),
    /// Listed, not readable (reason in the table entry).
    Nowhere,
}

pub struct LayeredBackend {
    primary: Box<dyn Backend>,
    /// Shared: encoding jobs read the dense model through it.
    fallback: Option<Arc<dyn Backend>>,
    table: TensorTable,
    routes: Vec<Route>,
}

/// A vocabulary table held lossy-encoded (a sketch or .rknot blocks): never
/// served, since a compressed vocab table poisons the output. A compressed
/// file may hold one as ggml blocks (a self-contained .rknot) or lossless
/// blocks, which serve the dense values exactly.
pub(crate) fn is_lossy_vocab(t: &TensorInfo) -> bool {
    names::is_vocab_tensor(&t.name.dot)
        && !matches!(t.stored, StoredType::Ggml(_) | StoredType::RknotLossless(_))
}

impl LayeredBackend {
    pub fn new(primary: Box<dyn Backend>, fallback: Option<Box<dyn Backend>>) -> Result<Self> {
        let mut table = TensorTable::default();
        let mut routes = Vec::new();
        let mut used_primary = vec![false; primary.tensors().len()];
        let vocab_reason = |name: &str| {
            format!(
                "{name} is never served lossy-encoded, from a sketch or .rknot blocks (a \
                 compressed vocab table poisons the output); attach a dense fallback with --dense"
            )
        };
        let p_tab = primary.tensors();
        if let Some(fb) = &fallback {
            for (fi, finfo) in fb.tensors().entries().iter().enumerate() {
                let dot = &finfo.name.dot;
                let route = match p_tab.get(dot) {
                    Some(pi) if !is_lossy_vocab(&p_tab.entries()[pi]) => {
                        let pinfo = &p_tab.entries()[pi];
                        if pinfo.shape != finfo.shape {
                            return Err(err(
                                ErrorKind::ShapeMismatch,
                                format!(
                                    "primary {} has shape {:?}, fallback {} has {:?}",
                                    pinfo.origin.path.display(),
                                    pinfo.shape,
                                    finfo.origin.path.display(),
                                    finfo.shape
                                ),
                            )
                            .tensor(dot));
                        }
                        used_primary[pi] = true;
                        Route::Primary(pi)
                    }
                    Some(pi) => {
                        used_primary[pi] = true;
                        Route::Fallback(fi)
                    }
                    None => Route::Fallback(fi),
                };
                let mut info = match route {
                    Route::Primary(pi) => p_tab.entries()[pi].clone(),
                    _ => finfo.clone(),
                };
                info.origin.role = match route {
                    Route::Primary(_) => Role::Primary,
                    _ => Role::Fallback,
                };
                let from = info.origin.path.clone();
                table.push(info, dot).map_err(|e| e.path(&from))?;
                routes.push(route);
            }
        }
        // Primary tensors the fallback does not have (or no fallback at all).
        for (pi, pinfo) in p_tab.entries().iter().enumerate() {
            if used_primary[pi] {
                continue;
            }
            let mut info: TensorInfo = pinfo.clone();
            info.origin.role = Role::Primary;
            let route = if is_lossy_vocab(&info) {
                info.availability = Availability::Unavailable(vocab_reason(&info.name.dot));
                Route::Nowhere
            } else {
                Route::Primary(pi)
            };
            let stored = info.name.dot.clone();
            let from = info.origin.path.clone();
            table.push(info, &stored).map_err(|e| e.path(&from))?;
            routes.push(route);
        }
        Ok(LayeredBackend {
            primary,
            fallback: fallback.map(Arc::from),
            table,
            routes,
        })
    }
}

impl Backend for LayeredBackend {
    fn summary(&self) -> &SourceSummary {
        self.primary.summary()
    }

    fn fallback_summary(&self) -> Option<&SourceSummary> {
        self.fallback.as_ref().map(|f| f.summary())
    }

    fn tensors(&self) -> &TensorTable {
        &self.table
    }

    fn source_files(&self) -> Vec<&SourceFile> {
        let mut files = self.primary.source_files();
        if let Some(fb) = &self.fallback {
            files.extend(fb.source_files());
        }
        files
    }

    fn fallback_backend(&self) -> Option<Arc<dyn Backend>> {
        self.fallback.clone()
    }

    fn stored_ranges(&self, index: usize) -> Option<super::StoredRanges<'_>> {
        match self.routes.get(index)? {
            Route::Primary(i) => self.primary.stored_ranges(*i),
            Route::Fallback(i) => self.fallback.as_ref()?.stored_ranges(*i),
            Route::Nowhere => None,
        }
    }

    fn block_code(&self, index: usize) -> Option<super::BlockCode> {
        match self.routes.get(index)? {
            Route::Primary(i) => self.primary.block_code(*i),
            Route::Fallback(i) => self.fallback.as_ref()?.block_code(*i),
            Route::Nowhere => None,
        }
    }

    fn read_stored_blocks(&self, index: usize, offset: u64, buf: &mut [u8]) -> Result<()> {
        match self.routes.get(index) {
            Some(Route::Primary(i)) => self.primary.read_stored_blocks(*i, offset, buf),
            Some(Route::Fallback(i)) => match &self.fallback {
                Some(fb) => fb.read_stored_blocks(*i, offset, buf),
                None => Err(err(ErrorKind::Unavailable, "no fallback attached")),
            },
            // An unavailable table's error, naming why.
            Some(Route::Nowhere) => self
                .table
                .info(index)
                .map_or(Ok(()), |info| super::check_read(info, 0, 0))
                .and_then(|()| Err(err(ErrorKind::Unavailable, "served from nowhere"))),
            None => Err(super::no_such_index(index)),
        }
    }

    fn read_f32(&self, index: usize, first_elem: u64, out: &mut [f32]) -> Result<()> {
        match self.routes.get(index) {
            Some(Route::Primary(i)) => self.primary.read_f32(*i, first_elem, out),
            Some(Route::Fallback(i)) => match &self.fallback {
                Some(fb) => fb.read_f32(*i, first_elem, out),
                None => Err(err(ErrorKind::Unavailable, "no fallback attached")),
            },
            Some(Route::Nowhere) => {
                let info = &self.table.entries()[index];
                super::check_read(info, first_elem, out.len())
            }
            None => Err(super::no_such_index(index)),
        }
    }
}
