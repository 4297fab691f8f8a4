//! The remote-source flags shared by `rknot-mount` and every `rknot`
//! subcommand that opens sources ([`RemoteArgs`], flattened into each), and
//! their checks, which the mount's `-o` forms use too.

use std::path::PathBuf;

use clap::Args;

use super::options::RemoteOptions;

/// How remote (`s3://`, `http(s)://`) sources are reached and cached.
#[derive(Args, Debug, Clone, Default, PartialEq)]
#[command(next_help_heading = "Remote sources (s3://, http(s)://)")]
pub struct RemoteArgs {
    /// S3 endpoint URL of an S3-compatible store (MinIO, R2, Ceph):
    /// overrides AWS_ENDPOINT_URL and the AWS profile's endpoint_url;
    /// requests then use path-style addressing, and plain http is allowed
    /// only when this URL is http://.
    #[arg(long, value_name = "URL", value_parser = parse_endpoint)]
    pub endpoint: Option<String>,
    /// PEM bundle of CA certificates trusted for https, besides the
    /// system's (certificates are always verified).
    #[arg(long, value_name = "FILE", value_parser = parse_ca_bundle)]
    pub ca_bundle: Option<PathBuf>,
    /// Persistent disk cache of fetched parts (created 0700), shared by
    /// mounts and commands on this host.
    #[arg(long, value_name = "DIR")]
    pub source_cache: Option<PathBuf>,
    /// Size limit of --source-cache in GB (10^9 bytes, fractions allowed)
    /// [default: 10].
    #[arg(long, value_name = "GB", value_parser = parse_gb, requires = "source_cache")]
    pub source_cache_gb: Option<f64>,
    /// Memory cache of fetched parts per remote source, MiB, at least 1
    /// [default: 256].
    #[arg(long, value_name = "MIB", value_parser = parse_remote_cache_mb)]
    pub remote_cache_mb: Option<u64>,
    /// Bytes fetched per request (the unit of caching), MiB, 1..=1024
    /// [default: 8].
    #[arg(long, value_name = "MIB", value_parser = parse_part_size_mb)]
    pub part_size_mb: Option<u64>,
    /// Retries of a failed request (timeouts, resets, 5xx, 429) before the
    /// read fails, 0..=100 [default: 5].
    #[arg(long, value_name = "N", value_parser = parse_retries)]
    pub remote_retries: Option<u32>,
    /// The longest a read of remote data may wait, every retry included,
    /// before it fails with EIO (a server that stalls or stops answering);
    /// opening waits at most 10 s of it. Seconds, fractions allowed,
    /// up to 3600 [default: 30].
    #[arg(long, value_name = "SECS", value_parser = parse_deadline)]
    pub remote_deadline: Option<f64>,
}

/// The range of `--part-size-mb`: one MiB (a ranged GET costs a round
/// trip: smaller parts would be dominated by it) to 1 GiB (a part is
/// held in memory whole).
pub const PART_SIZE_MB: std::ops::RangeInclusive<u64> = 1..=1024;

/// The most retries: with backoff capped at 5 s, 100 retries already stall
/// a read for minutes.
pub const MAX_RETRIES: u32 = 100;

pub fn check_endpoint(e: &str) -> Result<String, String> {
    super::s3::check_endpoint(e)?;
    Ok(e.to_string())
}

pub fn check_part_size_mb(n: u64) -> Result<u64, String> {
    if PART_SIZE_MB.contains(&n) {
        Ok(n)
    } else {
        Err(format!(
            "{n} MiB: a part is {}..={} MiB",
            PART_SIZE_MB.start(),
            PART_SIZE_MB.end()
        ))
    }
}

pub fn check_remote_cache_mb(n: u64) -> Result<u64, String> {
    if n == 0 {
        return Err("at least 1 MiB".into());
    }
    Ok(n)
}

pub fn check_retries(n: u32) -> Result<u32, String> {
    if n > MAX_RETRIES {
        return Err(format!("{n}: at most {MAX_RETRIES} retries"));
    }
    Ok(n)
}

pub fn check_deadline(secs: f64) -> Result<f64, String> {
    let max = super::options::MAX_DEADLINE.as_secs_f64();
    if !(secs.is_finite() && secs >= 0.1 && secs <= max) {
        return Err(format!("{secs} s: a deadline is 0.1..={max} seconds"));
    }
    Ok(secs)
}

pub fn check_gb(n: f64) -> Result<f64, String> {
    if !(n.is_finite() && n > 0.0 && n < 1e9) {
        return Err(format!("{n} GB: a size above 0 is needed"));
    }
    Ok(n)
}

fn parse_endpoint(s: &str) -> Result<String, String> {
    check_endpoint(s)
}

fn parse_ca_bundle(s: &str) -> Result<PathBuf, String> {
    let p = PathBuf::from(s);
    super::s3::read_ca_bundle(&p)?;
    Ok(p)
}

fn parse_gb(s: &str) -> Result<f64, String> {
    check_gb(s.parse().map_err(|_| "not a number".to_string())?)
}

fn parse_remote_cache_mb(s: &str) -> Result<u64, String> {
    check_remote_cache_mb(s.parse().map_err(|_| "not a number".to_string())?)
}

fn parse_part_size_mb(s: &str) -> Result<u64, String> {
    check_part_size_mb(s.parse().map_err(|_| "not a number".to_string())?)
}

fn parse_deadline(s: &str) -> Result<f64, String> {
    check_deadline(
        s.parse()
            .map_err(|_| "not a number of seconds".to_string())?,
    )
}

fn parse_retries(s: &str) -> Result<u32, String> {
    check_retries(s.parse().map_err(|_| "not a number".to_string())?)
}

impl RemoteArgs {
    /// These flags, with `fallback`'s values where a flag is not given (the
    /// mount's `-o` forms: flags win).
    pub fn or(&self, fallback: &RemoteArgs) -> RemoteArgs {
        RemoteArgs {
            endpoint: self.endpoint.clone().or_else(|| fallback.endpoint.clone()),
            ca_bundle: self
                .ca_bundle
                .clone()
                .or_else(|| fallback.ca_bundle.clone()),
            source_cache: self
                .source_cache
                .clone()
                .or_else(|| fallback.source_cache.clone()),
            source_cache_gb: self.source_cache_gb.or(fallback.source_cache_gb),
            remote_cache_mb: self.remote_cache_mb.or(fallback.remote_cache_mb),
            part_size_mb: self.part_size_mb.or(fallback.part_size_mb),
            remote_retries: self.remote_retries.or(fallback.remote_retries),
            remote_deadline: self.remote_deadline.or(fallback.remote_deadline),
        }
    }

    /// `base` with these flags applied (values checked again: the `-o`
    /// forms and callers building the struct by hand come here too).
    pub fn apply(&self, base: RemoteOptions) -> Result<RemoteOptions, String> {
        let mut o = base;
        if let Some(e) = &self.endpoint {
            o.endpoint = Some(check_endpoint(e).map_err(|m| format!("endpoint {e:?}: {m}"))?);
        }
        if let Some(p) = &self.ca_bundle {
            super::s3::read_ca_bundle(p)?;
            o.ca_bundle = Some(std::path::absolute(p).unwrap_or_else(|_| p.clone()));
        }
        if self.source_cache_gb.is_some() && self.source_cache.is_none() {
            return Err("source_cache_gb needs source_cache=DIR (--source-cache)".into());
        }
        if let Some(d) = &self.source_cache {
            o.source_cache = Some(std::path::absolute(d).unwrap_or_else(|_| d.clone()));
        }
        if let Some(gb) = self.source_cache_gb {
            o.source_cache_bytes = (check_gb(gb)? * 1e9) as u64;
        }
        if let Some(mb) = self.remote_cache_mb {
            o.cache_bytes = check_remote_cache_mb(mb)?.saturating_mul(1 << 20);
        }
        if let Some(mb) = self.part_size_mb {
            o.part_size = check_part_size_mb(mb)? << 20;
        }
        if let Some(n) = self.remote_retries {
            o.max_retries = check_retries(n)?;
        }
        if let Some(secs) = self.remote_deadline {
            o.deadline = std::time::Duration::from_secs_f64(check_deadline(secs)?);
        }
        Ok(o)
    }

    /// Make these flags the options of every later open of a URL in this
    /// process ([`RemoteOptions::set_current`], over
    /// [`RemoteOptions::from_env`]). Call before any source is opened.
    pub fn install(&self) -> Result<(), String> {
        RemoteOptions::set_current(self.apply(RemoteOptions::from_env())?);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_apply_and_win_over_fallbacks() {
        let flags = RemoteArgs {
            part_size_mb: Some(2),
            remote_retries: Some(0),
            ..RemoteArgs::default()
        };
        let o_forms = RemoteArgs {
            part_size_mb: Some(16),
            endpoint: Some("http://127.0.0.1:9".into()),
            ..RemoteArgs::default()
        };
        let merged = flags.or(&o_forms);
        let o = merged.apply(RemoteOptions::default()).unwrap();
        assert_eq!(o.part_size, 2 << 20);
        assert_eq!(o.max_retries, 0);
        assert_eq!(o.endpoint.as_deref(), Some("http://127.0.0.1:9"));
        let bad = RemoteArgs {
            source_cache_gb: Some(1.0),
            ..RemoteArgs::default()
        };
        assert!(bad.apply(RemoteOptions::default()).is_err());
        assert!(check_part_size_mb(0).is_err() && check_part_size_mb(1025).is_err());
        assert!(check_retries(101).is_err());
        let d = RemoteArgs {
            remote_deadline: Some(2.5),
            ..RemoteArgs::default()
        };
        let o = d.apply(RemoteOptions::default()).unwrap();
        assert_eq!(o.deadline, std::time::Duration::from_millis(2500));
        assert_eq!(o.open_budget(), std::time::Duration::from_millis(2500));
        assert!(check_deadline(0.0).is_err() && check_deadline(f64::NAN).is_err());
        assert!(check_deadline(3601.0).is_err() && check_deadline(30.0).is_ok());
        assert!(check_endpoint("s3.example.com").is_err());
    }
}
