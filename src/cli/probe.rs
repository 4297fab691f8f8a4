//! `rknot probe` and `rknot calibrate`: their arguments live with the code
//! they drive, in [`crate::probe`]; here only the remote flags are set.

use super::{CliResult, install_remote};
use crate::probe::ProbeArgs;
use crate::probe::calibrate::CalibrateArgs;

pub fn probe(a: ProbeArgs) -> CliResult {
    install_remote(&["probe"], &a.remote)?;
    crate::probe::run(a)
}

pub fn calibrate(a: CalibrateArgs) -> CliResult {
    install_remote(&["calibrate"], &a.remote)?;
    crate::probe::calibrate::run(a)
}
