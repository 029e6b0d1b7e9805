//! A real etcd (Debian `etcd-server`, `/usr/bin/etcd`) on free loopback ports with a
//! temp data dir, in its own process group so it never outlives the test. Optionally
//! with auth enabled (`etcdctl user add`/`auth enable`) or serving mTLS with
//! certificates from a throwaway rcgen CA.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use etcd_client::{Certificate, ConnectOptions, Identity, TlsOptions};
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
};

use super::replicas::StoreFixture;
use super::{TIMEOUT, free_port};

/// Where tests find etcd; override with `AETHER_ETCD_BIN`.
pub const ETCD_BIN_ENV: &str = "AETHER_ETCD_BIN";
pub const DEFAULT_ETCD_BIN: &str = "/usr/bin/etcd";

pub fn etcd_bin() -> PathBuf {
    let bin = PathBuf::from(std::env::var(ETCD_BIN_ENV).unwrap_or_else(|_| DEFAULT_ETCD_BIN.into()));
    assert!(
        bin.exists(),
        "etcd not found at {} (install Debian etcd-server via scripts/setup.sh, or set {ETCD_BIN_ENV})",
        bin.display()
    );
    bin
}

/// Where tests find etcdctl; override with `AETHER_ETCDCTL_BIN`.
pub const ETCDCTL_BIN_ENV: &str = "AETHER_ETCDCTL_BIN";
pub const DEFAULT_ETCDCTL_BIN: &str = "/usr/bin/etcdctl";
/// The least-privilege user the registrars log in as when auth is on.
pub const REGISTRAR_USER: &str = "aether-registrar";

/// PEM files of the fixture's TLS, all in its temp dir.
pub struct EtcdTls {
    /// The CA that signed the server and client certificates.
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    /// A client certificate etcd accepts (`--client-cert-auth`).
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
    /// A CA that signed nothing etcd uses.
    pub other_ca: PathBuf,
}

pub struct Etcd {
    child: Option<Child>,
    pub client_port: u16,
    peer_port: u16,
    dir: tempfile::TempDir,
    /// Key prefix given to the registrars: unique per fixture.
    pub prefix: String,
    pub tls: Option<EtcdTls>,
    /// root's password once auth is enabled.
    root_password: Option<String>,
    /// The registrars' user's password once auth is enabled.
    pub registrar_password: Option<String>,
    /// More etcd flags.
    extra: Vec<String>,
}

impl Etcd {
    /// Starts etcd and waits until it answers.
    pub async fn start() -> Etcd {
        Self::start_with(&[]).await
    }

    /// As [`Etcd::start`], with more etcd flags.
    pub async fn start_with(extra: &[&str]) -> Etcd {
        let mut etcd = Self::new();
        etcd.extra = extra.iter().map(|s| s.to_string()).collect();
        etcd.spawn().await;
        etcd
    }

    /// Starts etcd serving https:// only to clients with a certificate from its CA.
    pub async fn start_mtls() -> Etcd {
        let mut etcd = Self::new();
        etcd.tls = Some(write_certificates(etcd.dir.path()));
        etcd.spawn().await;
        etcd
    }

    fn new() -> Etcd {
        Etcd {
            child: None,
            client_port: free_port(),
            peer_port: free_port(),
            dir: tempfile::Builder::new().prefix("aether-etcd-").tempdir().unwrap(),
            prefix: format!("/aether-test/{}", std::process::id()),
            tls: None,
            root_password: None,
            registrar_password: None,
            extra: Vec::new(),
        }
    }

    pub fn endpoint(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }

    /// Turns on etcd auth with etcdctl: a root user, and [`REGISTRAR_USER`] with
    /// read-write on the fixture's prefix only.
    pub fn enable_auth(&mut self, root_password: &str, registrar_password: &str) {
        let role = "aether-registrar-rw";
        let prefix = format!("{}/", self.prefix);
        self.etcdctl(&["user", "add", &format!("root:{root_password}")]);
        self.etcdctl(&["user", "add", &format!("{REGISTRAR_USER}:{registrar_password}")]);
        self.etcdctl(&["role", "add", role]);
        self.etcdctl(&["role", "grant-permission", role, "readwrite", "--prefix=true", &prefix]);
        self.etcdctl(&["user", "grant-role", REGISTRAR_USER, role]);
        self.etcdctl(&["auth", "enable"]);
        self.root_password = Some(root_password.to_owned());
        self.registrar_password = Some(registrar_password.to_owned());
    }

    /// Runs etcdctl (API v3) against this etcd as root (once auth is on), asserting success.
    pub fn etcdctl(&self, args: &[&str]) -> String {
        let bin = PathBuf::from(std::env::var(ETCDCTL_BIN_ENV).unwrap_or_else(|_| DEFAULT_ETCDCTL_BIN.into()));
        assert!(
            bin.exists(),
            "etcdctl not found at {} (install Debian etcd-client via scripts/setup.sh, or set {ETCDCTL_BIN_ENV})",
            bin.display()
        );
        let mut command = Command::new(&bin);
        command
            .env("ETCDCTL_API", "3")
            .arg(format!("--endpoints={}", self.endpoint()))
            .arg("--command-timeout=10s");
        if let Some(password) = &self.root_password {
            command.arg(format!("--user=root:{password}"));
        }
        if let Some(tls) = &self.tls {
            command
                .arg(format!("--cacert={}", tls.ca.display()))
                .arg(format!("--cert={}", tls.client_cert.display()))
                .arg(format!("--key={}", tls.client_key.display()));
        }
        let output = command
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("running etcdctl");
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        assert!(
            output.status.success(),
            "etcdctl {args:?} failed with {}: {stdout}{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
        stdout
    }

    /// How the fixture's own clients connect: its TLS client certificate, root when auth is on.
    fn connect_options(&self) -> Option<ConnectOptions> {
        let mut options = ConnectOptions::new().with_connect_timeout(Duration::from_secs(2));
        if let Some(password) = &self.root_password {
            options = options.with_user("root", password.clone());
        }
        if let Some(tls) = &self.tls {
            let pem = |p: &Path| std::fs::read(p).unwrap();
            options = options.with_tls(
                TlsOptions::new()
                    .ca_certificate(Certificate::from_pem(pem(&tls.ca)))
                    .identity(Identity::from_pem(pem(&tls.client_cert), pem(&tls.client_key))),
            );
        }
        Some(options)
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("etcd.log")
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    async fn spawn(&mut self) {
        assert!(self.child.is_none(), "etcd already running");
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .unwrap();
        let mut command = Command::new(etcd_bin());
        if let Some(tls) = &self.tls {
            command
                .arg(format!("--cert-file={}", tls.server_cert.display()))
                .arg(format!("--key-file={}", tls.server_key.display()))
                .arg("--client-cert-auth")
                .arg(format!("--trusted-ca-file={}", tls.ca.display()));
        }
        let child = command
            .args(&self.extra)
            .arg("--name=test")
            .arg(format!("--data-dir={}", self.dir.path().join("data").display()))
            .arg(format!("--listen-client-urls={}", self.endpoint()))
            .arg(format!("--advertise-client-urls={}", self.endpoint()))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=test={peer}"))
            .arg("--heartbeat-interval=50")
            .arg("--election-timeout=500")
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone().unwrap()))
            .stderr(Stdio::from(log))
            .spawn()
            .expect("spawning etcd");
        self.child = Some(child);
        let deadline = Instant::now() + TIMEOUT;
        loop {
            if let Ok(mut client) = etcd_client::Client::connect([self.endpoint()], self.connect_options()).await
                && client.get("/health-probe", None).await.is_ok()
            {
                return;
            }
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("etcd exited with {status} before answering:\n{}", self.logs());
            }
            assert!(
                Instant::now() < deadline,
                "etcd did not answer in time:\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGKILLs etcd's process group (data stays).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = killpg(Pid::from_raw(child.id() as i32), Signal::SIGKILL);
            let _ = child.wait();
        }
    }

    /// Starts etcd again on the same ports and data.
    pub async fn restart(&mut self) {
        self.kill();
        self.spawn().await;
    }

    pub async fn client(&self) -> etcd_client::Client {
        etcd_client::Client::connect([self.endpoint()], self.connect_options())
            .await
            .expect("connecting to etcd")
    }

    /// Compacts etcd's history up to its current revision.
    pub async fn compact(&self) -> i64 {
        let mut client = self.client().await;
        let revision = client
            .get("/", None)
            .await
            .unwrap()
            .header()
            .map(|h| h.revision())
            .unwrap();
        client
            .compact(revision, Some(etcd_client::CompactionOptions::new().with_physical()))
            .await
            .expect("compacting etcd");
        revision
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("---- etcd log ----\n{}", self.logs());
        }
        self.kill();
    }
}

impl StoreFixture for Etcd {
    fn name(&self) -> &'static str {
        "etcd"
    }

    fn registrar_args(&self) -> Vec<String> {
        let mut args = vec![
            "--store=etcd".into(),
            format!("--etcd-endpoints={}", self.endpoint()),
            format!("--etcd-prefix={}", self.prefix),
            "--etcd-timeout=1s".into(),
        ];
        if self.registrar_password.is_some() {
            args.push(format!("--etcd-username={REGISTRAR_USER}"));
        }
        if let Some(tls) = &self.tls {
            args.push(format!("--etcd-ca-file={}", tls.ca.display()));
            args.push(format!("--etcd-cert-file={}", tls.client_cert.display()));
            args.push(format!("--etcd-key-file={}", tls.client_key.display()));
        }
        args
    }

    /// The password goes in the environment, as a Secret would in the chart.
    fn env(&self) -> Vec<(String, String)> {
        self.registrar_password
            .iter()
            .map(|p| (aether_registrar::config::ETCD_PASSWORD_ENV.to_owned(), p.clone()))
            .collect()
    }

    async fn stop(&mut self) {
        self.kill();
    }

    async fn resume(&mut self) {
        self.spawn().await;
    }
}

fn ca(name: &str) -> (String, Issuer<'static, KeyPair>) {
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::default();
    params.distinguished_name.push(DnType::CommonName, name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let cert = params.self_signed(&key).unwrap();
    (cert.pem(), Issuer::new(params, key))
}

fn leaf(
    issuer: &Issuer<'static, KeyPair>,
    name: &str,
    sans: &[&str],
    usage: ExtendedKeyUsagePurpose,
) -> (String, String) {
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
    params.distinguished_name.push(DnType::CommonName, name);
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
    params.extended_key_usages = vec![usage];
    params.use_authority_key_identifier_extension = true;
    let cert = params.signed_by(&key, issuer).unwrap();
    (cert.pem(), key.serialize_pem())
}

/// A fresh CA, a server certificate for 127.0.0.1, a client certificate, and an unrelated CA.
fn write_certificates(dir: &Path) -> EtcdTls {
    let (ca_pem, issuer) = ca("aether test etcd CA");
    let (server_pem, server_key) = leaf(
        &issuer,
        "etcd",
        &["127.0.0.1", "localhost"],
        ExtendedKeyUsagePurpose::ServerAuth,
    );
    let (client_pem, client_key) = leaf(&issuer, REGISTRAR_USER, &[], ExtendedKeyUsagePurpose::ClientAuth);
    let (other_ca_pem, _) = ca("aether test unrelated CA");
    let write = |name: &str, pem: &str| {
        let path = dir.join(name);
        std::fs::write(&path, pem).unwrap();
        path
    };
    EtcdTls {
        ca: write("ca.pem", &ca_pem),
        server_cert: write("server.pem", &server_pem),
        server_key: write("server-key.pem", &server_key),
        client_cert: write("client.pem", &client_pem),
        client_key: write("client-key.pem", &client_key),
        other_ca: write("other-ca.pem", &other_ca_pem),
    }
}
