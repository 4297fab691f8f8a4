//! An S3-compatible server for tests: moto's `moto_server` (from
//! tools/moto-env.sh, found through `RKNOT_MOTO_SERVER`) on a free port of
//! 127.0.0.1, with boto3 from the same environment to create buckets, upload
//! and fetch objects and list multipart uploads. The child processes a test
//! runs get the server's endpoint and test credentials through [`S3::env`];
//! the server is killed when the [`S3`] is dropped.
//!
//! The server checks credentials and signatures as S3 does (moto's
//! authentication, on after its first requests, which create an IAM user
//! with an access key allowed everything): a request signed wrongly, or
//! with a wrong secret, gets 403.
#![allow(dead_code)]

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const REGION: &str = "us-east-1";

pub struct S3 {
    child: Child,
    pub port: u16,
    /// `http://127.0.0.1:PORT`
    pub endpoint: String,
    python: PathBuf,
    pub dir: tempfile::TempDir,
    /// The key the server made for the tests.
    pub access_key: String,
    pub secret_key: String,
}

/// The `moto_server` to run. Tests that call this are ignored at build time
/// without `RKNOT_MOTO_SERVER` (cfg `rknot_no_moto`); a binary built with
/// it and run without it fails rather than pass without testing.
pub fn moto_server() -> PathBuf {
    match std::env::var_os("RKNOT_MOTO_SERVER").filter(|v| !v.is_empty()) {
        Some(p) => PathBuf::from(p),
        None => panic!(
            "RKNOT_MOTO_SERVER is not set: run `export RKNOT_MOTO_SERVER=$(tools/moto-env.sh)` \
             (tools/test.sh does)"
        ),
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl S3 {
    /// Start a server and wait until it answers (a few tries: another
    /// process may take the free port between the probe and the bind).
    pub fn start() -> S3 {
        let server = moto_server();
        let python = server.with_file_name("python3");
        let mut dir = tempfile::tempdir().unwrap();
        let mut last_log = String::new();
        for _ in 0..3 {
            let port = free_port();
            let log = dir.path().join(format!("moto-{port}.log"));
            let out = std::fs::File::create(&log).unwrap();
            let child = Command::new(&server)
                // moto's switch for authentication: after this many
                // requests (the three of `create_key`) every request is
                // checked.
                .env("INITIAL_NO_AUTH_ACTION_COUNT", "3")
                .args(["-H", "127.0.0.1", "-p", &port.to_string()])
                .stdin(Stdio::null())
                .stdout(out.try_clone().unwrap())
                .stderr(out)
                .spawn()
                .unwrap_or_else(|e| panic!("cannot run {}: {e}", server.display()));
            let mut s = S3 {
                child,
                port,
                endpoint: format!("http://127.0.0.1:{port}"),
                python: python.clone(),
                dir,
                access_key: "unused".into(),
                secret_key: "unused".into(),
            };
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                if TcpStream::connect(("127.0.0.1", port)).is_ok() {
                    s.create_key();
                    return s;
                }
                if s.child.try_wait().ok().flatten().is_some() || Instant::now() > deadline {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            last_log = std::fs::read_to_string(&log).unwrap_or_default();
            let _ = s.child.kill();
            let _ = s.child.wait();
            dir = std::mem::replace(&mut s.dir, tempfile::tempdir().unwrap());
        }
        panic!("moto_server did not come up:\n{last_log}");
    }

    /// An IAM user with an access key allowed everything (the server's
    /// first three requests, made before it checks credentials).
    fn create_key(&mut self) {
        let out = self.boto(
            "import json\n\
             iam = boto3.client('iam', endpoint_url=s3.meta.endpoint_url, \
             aws_access_key_id='setup', aws_secret_access_key='setup', region_name='us-east-1')\n\
             iam.create_user(UserName='rknot-tests')\n\
             k = iam.create_access_key(UserName='rknot-tests')['AccessKey']\n\
             iam.put_user_policy(UserName='rknot-tests', PolicyName='all', PolicyDocument=\
             json.dumps({'Version': '2012-10-17', 'Statement': \
             [{'Effect': 'Allow', 'Action': '*', 'Resource': '*'}]}))\n\
             print(k['AccessKeyId'], k['SecretAccessKey'])",
            &[],
        );
        let mut words = out.split_whitespace();
        self.access_key = words.next().expect("an access key id").to_string();
        self.secret_key = words.next().expect("a secret key").to_string();
    }

    /// The environment the S3 client of rknot reads (test credentials,
    /// region, this server as AWS_ENDPOINT_URL), with the profile files
    /// pointed at nothing so the machine's own never count.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ENDPOINT_URL", self.endpoint.clone()),
            ("AWS_ACCESS_KEY_ID", self.access_key.clone()),
            ("AWS_SECRET_ACCESS_KEY", self.secret_key.clone()),
            ("AWS_REGION", REGION.into()),
            ("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent".into()),
            ("AWS_CONFIG_FILE", "/nonexistent".into()),
        ]
    }

    /// `cmd` with [`S3::env`] (and no other AWS_* of the test's own
    /// environment).
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new(program);
        for (k, _) in std::env::vars_os() {
            if k.to_string_lossy().starts_with("AWS_") {
                c.env_remove(k);
            }
        }
        c.envs(self.env());
        c
    }

    /// Run `script` with boto3's client of this server as `s3` and `argv`
    /// as sys.argv[1:]; its stdout. Panics when it fails.
    pub fn boto(&self, script: &str, argv: &[&str]) -> String {
        let prelude = format!(
            "import sys, boto3\n\
             s3 = boto3.client('s3', endpoint_url='{}', aws_access_key_id='{}', \
             aws_secret_access_key='{}', region_name='{REGION}')\n",
            self.endpoint, self.access_key, self.secret_key
        );
        let o = Command::new(&self.python)
            .arg("-c")
            .arg(format!("{prelude}{script}"))
            .args(argv)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", self.python.display()));
        assert!(
            o.status.success(),
            "boto3 script failed:\n{script}\n{}",
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8(o.stdout).unwrap()
    }

    pub fn create_bucket(&self, bucket: &str) {
        self.boto("s3.create_bucket(Bucket=sys.argv[1])", &[bucket]);
    }

    /// Upload local `file` as `s3://bucket/key` (boto3's transfer: a
    /// multipart upload for large files).
    pub fn upload(&self, file: &Path, bucket: &str, key: &str) {
        self.boto(
            "s3.upload_file(sys.argv[1], sys.argv[2], sys.argv[3])",
            &[file.to_str().unwrap(), bucket, key],
        );
    }

    /// The bytes of `s3://bucket/key`, or None when there is no such
    /// object.
    pub fn get(&self, bucket: &str, key: &str) -> Option<Vec<u8>> {
        let out = self.dir.path().join("download");
        let _ = std::fs::remove_file(&out);
        let found = self.boto(
            "import botocore\n\
             try:\n    s3.download_file(sys.argv[1], sys.argv[2], sys.argv[3]); print('yes')\n\
             except botocore.exceptions.ClientError as e:\n    \
             assert e.response['Error']['Code'] in ('404', 'NoSuchKey'), e\n    print('no')",
            &[bucket, key, out.to_str().unwrap()],
        );
        (found.trim() == "yes").then(|| std::fs::read(&out).unwrap())
    }

    /// The keys of `bucket`.
    pub fn keys(&self, bucket: &str) -> Vec<String> {
        let out = self.boto(
            "for o in s3.list_objects_v2(Bucket=sys.argv[1]).get('Contents', []): print(o['Key'])",
            &[bucket],
        );
        out.lines().map(str::to_string).collect()
    }

    /// The keys of the multipart uploads in progress in `bucket`.
    pub fn uploads_in_progress(&self, bucket: &str) -> Vec<String> {
        let out = self.boto(
            "for u in s3.list_multipart_uploads(Bucket=sys.argv[1]).get('Uploads', []): \
             print(u['Key'])",
            &[bucket],
        );
        out.lines().map(str::to_string).collect()
    }

    pub fn log(&self) -> String {
        let mut s = String::new();
        for e in std::fs::read_dir(self.dir.path()).unwrap().flatten() {
            if e.file_name().to_string_lossy().starts_with("moto-") {
                s += &std::fs::read_to_string(e.path()).unwrap_or_default();
            }
        }
        s
    }
}

impl Drop for S3 {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
