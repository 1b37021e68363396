//! The interception CA: `sluice ca new` writes one; at run time it signs a leaf
//! certificate per host name on demand, cached so that a second connection to the same
//! name does no signing.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use rustls::sign::CertifiedKey;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

use super::{TlsError, provider};
use crate::config::read_capped;

/// A CA certificate and key are a few KiB of PEM; anything much larger is the wrong file.
const PEM_CAP: u64 = 1 << 20;

/// Leaves live 30 days and are replaced a day before they expire.
const LEAF_LIFETIME: Duration = Duration::from_secs(30 * 24 * 3600);
const LEAF_RENEW_BEFORE: Duration = Duration::from_secs(24 * 3600);
/// Distinct host names whose leaves are kept; beyond it the oldest is dropped.
const CACHE_LIMIT: usize = 10_000;

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> TlsError + '_ {
    move |source| TlsError::Io {
        path: path.display().to_string(),
        source,
    }
}

fn offset(t: SystemTime) -> time::OffsetDateTime {
    time::OffsetDateTime::from(t)
}

/// Writes `ca.pem` and `ca-key.pem` (mode 0600) into `dir`: an ECDSA P-256 CA valid for
/// ten years, named "sluice egress CA" plus this host's name.
pub fn write_new_ca(dir: &Path) -> Result<(PathBuf, PathBuf), TlsError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;

    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let (cert, key) = new_ca()?;
    let cert_path = dir.join("ca.pem");
    let key_path = dir.join("ca-key.pem");
    std::fs::write(&cert_path, cert.pem()).map_err(io_err(&cert_path))?;
    let _ = std::fs::remove_file(&key_path);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&key_path)
        .map_err(io_err(&key_path))?;
    f.write_all(key.serialize_pem().as_bytes())
        .map_err(io_err(&key_path))?;
    Ok((cert_path, key_path))
}

/// A new CA: ECDSA P-256, valid for ten years, named "sluice egress CA" plus this host's
/// name.
fn new_ca() -> Result<(rcgen::Certificate, KeyPair), TlsError> {
    let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
    let mut params = CertificateParams::default();
    let host = std::fs::read_to_string("/etc/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default();
    let mut dn = DistinguishedName::new();
    let cn = if host.is_empty() {
        "sluice egress CA".to_string()
    } else {
        format!("sluice egress CA {host}")
    };
    dn.push(DnType::CommonName, cn);
    dn.push(DnType::OrganizationName, "sluice");
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let now = SystemTime::now();
    params.not_before = offset(now - Duration::from_secs(3600));
    params.not_after = offset(now + Duration::from_secs(10 * 365 * 24 * 3600));
    let cert = params.self_signed(&key)?;
    Ok((cert, key))
}

struct Leaf {
    key: Arc<CertifiedKey>,
    renew_at: SystemTime,
    issued: u64,
}

/// A loaded CA and its cache of leaf certificates.
pub struct Authority {
    issuer: Issuer<'static, KeyPair>,
    ca_der: CertificateDer<'static>,
    cache: Mutex<(HashMap<String, Leaf>, u64)>,
}

impl Authority {
    /// Loads a CA; refuses a key file that others can read or its group can change. The
    /// group may read it: a Kubernetes Secret volume with `fsGroup` gives 0440, and only
    /// the containers that mount the volume see the file at all.
    pub(crate) fn load(cert_path: &Path, key_path: &Path) -> Result<Authority, TlsError> {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(key_path)
            .map_err(io_err(key_path))?
            .permissions()
            .mode();
        if mode & 0o037 != 0 {
            return Err(TlsError::KeyTooOpen(key_path.display().to_string()));
        }
        let cert_pem = read_capped(cert_path, PEM_CAP).map_err(io_err(cert_path))?;
        let key_pem = read_capped(key_path, PEM_CAP).map_err(|e| unreadable(key_path, e))?;
        let invalid = |path: &Path, message: String| TlsError::Invalid {
            path: path.display().to_string(),
            message,
        };
        let key = KeyPair::from_pem(&key_pem)
            .map_err(|e| invalid(key_path, format!("not a usable private key: {e}")))?;
        let ca_der = pem_certs(&cert_pem)
            .into_iter()
            .next()
            .ok_or_else(|| invalid(cert_path, "no certificate in the file".into()))?;
        Authority::from_parts(ca_der, key)
            .map_err(|e| invalid(cert_path, format!("not a usable CA certificate: {e}")))
    }

    fn from_parts(
        ca_der: CertificateDer<'static>,
        key: KeyPair,
    ) -> Result<Authority, rcgen::Error> {
        Ok(Authority {
            issuer: Issuer::from_ca_cert_der(&ca_der, key)?,
            ca_der,
            cache: Mutex::new((HashMap::new(), 0)),
        })
    }

    /// A CA made now, whose key is never written anywhere.
    pub fn generate() -> Result<Authority, TlsError> {
        let (cert, key) = new_ca()?;
        Ok(Authority::from_parts(cert.der().clone(), key)?)
    }

    /// A generated CA kept in `dir` (a volume only sluice mounts), so that a restarted
    /// sidecar keeps the CA its application already trusts: loaded when it is there,
    /// made and written (key 0600) when it is not.
    pub fn generate_in(dir: &Path) -> Result<Authority, TlsError> {
        let (cert, key) = (dir.join("ca.pem"), dir.join("ca-key.pem"));
        if !(cert.exists() && key.exists()) {
            write_new_ca(dir)?;
        }
        Authority::load(&cert, &key)
    }

    /// Writes what the application trusts into `dir` (shared with it; public
    /// certificates only): `ca.pem`, this CA, for runtimes that add extra roots to their
    /// own (`NODE_EXTRA_CA_CERTS`), and `ca-bundle.pem`, the public roots sluice itself
    /// trusts (Mozilla's, from webpki-root-certs) followed by this CA, for those that
    /// take one file (`SSL_CERT_FILE`, `REQUESTS_CA_BUNDLE`, `CURL_CA_BUNDLE`). Each file
    /// is replaced whole (written aside, then renamed), so a reader never sees half.
    pub fn write_trust(&self, dir: &Path) -> Result<(), TlsError> {
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        let ca = pem::encode(&pem::Pem::new("CERTIFICATE", self.ca_der.to_vec()));
        let mut bundle: String = webpki_root_certs::TLS_SERVER_ROOT_CERTS
            .iter()
            .map(|c| pem::encode(&pem::Pem::new("CERTIFICATE", c.to_vec())))
            .collect();
        bundle.push_str(&ca);
        for (name, text) in [("ca.pem", &ca), ("ca-bundle.pem", &bundle)] {
            let path = dir.join(name);
            let aside = dir.join(format!(".{name}.new"));
            std::fs::write(&aside, text).map_err(io_err(&aside))?;
            std::fs::rename(&aside, &path).map_err(io_err(&path))?;
        }
        Ok(())
    }

    /// The leaf for `name`, from the cache or freshly signed.
    pub(crate) fn leaf(&self, name: &str) -> Result<Arc<CertifiedKey>, TlsError> {
        let now = SystemTime::now();
        {
            let cache = self.cache.lock();
            if let Some(l) = cache.0.get(name).filter(|l| l.renew_at > now) {
                return Ok(l.key.clone());
            }
        }
        let key = Arc::new(self.sign(name, now)?);
        let mut cache = self.cache.lock();
        let (map, counter) = &mut *cache;
        *counter += 1;
        if map.len() >= CACHE_LIMIT
            && !map.contains_key(name)
            && let Some(oldest) = map
                .iter()
                .min_by_key(|(_, l)| l.issued)
                .map(|(k, _)| k.clone())
        {
            map.remove(&oldest);
        }
        map.insert(
            name.to_string(),
            Leaf {
                key: key.clone(),
                renew_at: now + LEAF_LIFETIME - LEAF_RENEW_BEFORE,
                issued: *counter,
            },
        );
        Ok(key)
    }

    /// How many leaves have been signed since start.
    #[cfg(test)]
    pub(crate) fn signed(&self) -> u64 {
        self.cache.lock().1
    }

    fn sign(&self, name: &str, now: SystemTime) -> Result<CertifiedKey, TlsError> {
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
        let mut params = CertificateParams::default();
        params.subject_alt_names = vec![match name.parse::<std::net::IpAddr>() {
            Ok(ip) => SanType::IpAddress(ip),
            Err(_) => SanType::DnsName(name.try_into()?),
        }];
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, name);
        params.distinguished_name = dn;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.not_before = offset(now - Duration::from_secs(3600));
        params.not_after = offset(now + LEAF_LIFETIME);
        let cert = params.signed_by(&key, &self.issuer)?;
        let der_key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let signing = provider().key_provider.load_private_key(der_key)?;
        Ok(CertifiedKey::new(
            vec![cert.der().clone(), self.ca_der.clone()],
            signing,
        ))
    }
}

/// Every certificate in a PEM text.
pub(crate) fn pem_certs(pem: &str) -> Vec<CertificateDer<'static>> {
    use rustls_pki_types::pem::PemObject;
    CertificateDer::pem_slice_iter(pem.as_bytes())
        .filter_map(Result::ok)
        .collect()
}

/// A key file sluice may not read: in a pod, almost always a Secret volume without
/// `fsGroup`, whose files the kubelet leaves to root. The error says so.
fn unreadable(path: &Path, e: std::io::Error) -> TlsError {
    use std::os::unix::fs::MetadataExt;
    match std::fs::metadata(path) {
        Ok(m) if e.kind() == std::io::ErrorKind::PermissionDenied => TlsError::KeyUnreadable {
            path: path.display().to_string(),
            uid: m.uid(),
            gid: m.gid(),
            mode: m.mode() & 0o7777,
            euid: rustix::process::geteuid().as_raw(),
            egid: rustix::process::getegid().as_raw(),
        },
        _ => io_err(path)(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_ca_signs_cached_leaves_and_guards_its_key() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = write_new_ca(dir.path()).unwrap();
        assert_eq!(
            std::fs::metadata(&key).unwrap().permissions().mode() & 0o777,
            0o600
        );
        let ca = Authority::load(&cert, &key).unwrap();
        let a = ca.leaf("api.example.com").unwrap();
        let b = ca.leaf("api.example.com").unwrap();
        assert!(Arc::ptr_eq(&a, &b), "the second connection reuses the leaf");
        assert_eq!(ca.signed(), 1);
        ca.leaf("127.0.0.1").unwrap();
        assert_eq!(ca.signed(), 2);

        // What Secret volumes give: 0440 with fsGroup, 0400 without.
        for mode in [0o400, 0o440, 0o640] {
            std::fs::set_permissions(&key, std::fs::Permissions::from_mode(mode)).unwrap();
            assert!(Authority::load(&cert, &key).is_ok(), "{mode:o}");
        }
        // Readable by others (a Secret's default 0644), or writable by the group.
        for mode in [0o644, 0o604, 0o660, 0o650] {
            std::fs::set_permissions(&key, std::fs::Permissions::from_mode(mode)).unwrap();
            let err = Authority::load(&cert, &key).err().unwrap().to_string();
            assert!(err.contains("chmod 600"), "{mode:o}: {err}");
        }
    }
}
