//! Tenants and their API keys. A verifier serving more than its own machine reads them from a TOML
//! file (`cloud serve --tenants FILE`):
//!
//! ```toml
//! [[tenant]]
//! name = "acme"
//! keys = ["acme-7c1f0a9e2b44d3e8"]
//! weight = 3.0          # share under saturation (default 1)
//! max_sessions = 64     # optional quotas
//! max_kv_blocks = 2000
//! tokens_per_s = 5000.0
//! prefix_cache_salt = "public"   # optional: share cached prompt pages with the tenants
//!                                # that name the same salt (default: its own, isolated)
//! ```
//!
//! Every RPC then carries `authorization: Bearer <key>`; the key names the tenant, and a session is
//! bound to the tenant that opened it. Without a file, one tenant (`default`) and no keys: allowed
//! only on a loopback address and only when asked for explicitly.

use std::path::Path;

use serde::Deserialize;
use tandem_sched::{TenantConfig, TenantId};

/// Shortest accepted API key.
pub const MIN_KEY_LEN: usize = 16;

#[derive(Debug, thiserror::Error)]
pub enum TenantsError {
    #[error("reading {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("tenants file: {0}")]
    Parse(String),
    #[error("tenant {tenant:?}: {message}")]
    Invalid { tenant: String, message: String },
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    name: String,
    keys: Vec<String>,
    #[serde(default = "one")]
    weight: f64,
    max_sessions: Option<usize>,
    max_kv_blocks: Option<usize>,
    tokens_per_s: Option<f64>,
    prefix_cache_salt: Option<String>,
}

fn one() -> f64 {
    1.0
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    tenant: Vec<Entry>,
}

/// Why a caller was not let in (answered `UNAUTHENTICATED`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("authorization: {0}")]
pub struct AuthError(pub String);

/// The tenants and their keys. Keys are kept only as SHA-256 digests and compared in constant
/// time (every key is compared, whichever matches); `Debug` shows no key.
#[derive(Clone)]
pub struct Tenants {
    names: Vec<String>,
    configs: Vec<TenantConfig>,
    keys: Vec<([u8; 32], TenantId)>,
    auth: bool,
}

impl std::fmt::Debug for Tenants {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tenants")
            .field("names", &self.names)
            .field("configs", &self.configs)
            .field("keys", &format_args!("<{} redacted>", self.keys.len()))
            .field("auth", &self.auth)
            .finish()
    }
}

fn digest(key: &str) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(key.as_bytes()).into()
}

impl Tenants {
    /// One tenant, `default`, and no authentication.
    pub fn open() -> Self {
        Self {
            names: vec!["default".into()],
            configs: vec![TenantConfig::default()],
            keys: Vec::new(),
            auth: false,
        }
    }

    pub fn from_toml(text: &str) -> Result<Self, TenantsError> {
        let f: File = toml::from_str(text).map_err(|e| TenantsError::Parse(e.to_string()))?;
        if f.tenant.is_empty() {
            return Err(TenantsError::Parse("no [[tenant]] entries".into()));
        }
        let mut t = Self {
            names: Vec::new(),
            configs: Vec::new(),
            keys: Vec::new(),
            auth: true,
        };
        for (i, e) in f.tenant.into_iter().enumerate() {
            let bad = |message: String| TenantsError::Invalid {
                tenant: e.name.clone(),
                message,
            };
            if e.name.is_empty() || t.names.contains(&e.name) {
                return Err(bad("name: empty or used twice".into()));
            }
            if e.keys.is_empty() {
                return Err(bad("keys: at least one API key is needed".into()));
            }
            for k in &e.keys {
                if k.len() < MIN_KEY_LEN || !k.chars().all(|c| c.is_ascii_graphic()) {
                    return Err(bad(format!(
                        "keys: a key must be at least {MIN_KEY_LEN} printable ASCII characters"
                    )));
                }
                let d = digest(k);
                if t.keys.iter().any(|(x, _)| *x == d) {
                    return Err(bad("keys: a key is used twice".into()));
                }
                t.keys.push((d, TenantId(i as u32)));
            }
            let cfg = TenantConfig {
                weight: e.weight,
                max_sessions: e.max_sessions,
                max_kv_blocks: e.max_kv_blocks,
                tokens_per_s: e.tokens_per_s,
                cache_salt: e
                    .prefix_cache_salt
                    .as_deref()
                    .map(tandem_sched::shared_salt),
            };
            if e.prefix_cache_salt.as_ref().is_some_and(|s| s.is_empty()) {
                return Err(bad("prefix_cache_salt: must not be empty".into()));
            }
            if !(cfg.weight.is_finite() && cfg.weight > 0.0) {
                return Err(bad(format!("weight: must be positive, got {}", cfg.weight)));
            }
            if cfg
                .tokens_per_s
                .is_some_and(|r| !(r.is_finite() && r > 0.0))
            {
                return Err(bad("tokens_per_s: must be positive".into()));
            }
            t.names.push(e.name);
            t.configs.push(cfg);
        }
        Ok(t)
    }

    pub fn load(path: &Path) -> Result<Self, TenantsError> {
        let text = std::fs::read_to_string(path).map_err(|source| TenantsError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_toml(&text)
    }

    pub fn auth_required(&self) -> bool {
        self.auth
    }

    /// Tenant names, indexed by [`TenantId`].
    pub fn names(&self) -> &[String] {
        &self.names
    }

    pub fn configs(&self) -> impl Iterator<Item = (TenantId, TenantConfig)> + '_ {
        self.configs
            .iter()
            .enumerate()
            .map(|(i, c)| (TenantId(i as u32), *c))
    }

    /// The tenant an `authorization` header value (`Bearer <key>`) names.
    pub fn authenticate(&self, header: Option<&str>) -> Result<TenantId, AuthError> {
        if !self.auth {
            return Ok(TenantId(0));
        }
        let Some(h) = header else {
            return Err(AuthError(
                "missing API key (send `authorization: Bearer <key>`)".into(),
            ));
        };
        let key = h
            .strip_prefix("Bearer ")
            .ok_or_else(|| AuthError("expected `Bearer <key>`".into()))?;
        // Constant time: the presented key's digest against every stored one, no early exit.
        use subtle::{ConditionallySelectable, ConstantTimeEq};
        let d = digest(key.trim());
        let mut found = subtle::Choice::from(0);
        let mut tenant = 0u32;
        for (k, t) in &self.keys {
            let hit = k.ct_eq(&d);
            tenant = u32::conditional_select(&tenant, &t.0, hit);
            found |= hit;
        }
        if bool::from(found) {
            Ok(TenantId(tenant))
        } else {
            Err(AuthError("unknown API key".into()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = r#"
[[tenant]]
name = "acme"
keys = ["acme-0123456789abcdef"]
weight = 3.0
max_sessions = 4

[[tenant]]
name = "beta"
keys = ["beta-0123456789abcdef", "beta-fedcba9876543210"]
"#;

    /// Keys are never kept or shown as text: `Debug` redacts them, and the struct holds
    /// digests only.
    #[test]
    fn keys_are_redacted_and_kept_hashed() {
        let t = Tenants::from_toml(FILE).unwrap();
        let shown = format!("{t:?}");
        assert!(!shown.contains("0123456789abcdef"), "{shown}");
        assert!(shown.contains("3 redacted"), "{shown}");
        assert_eq!(t.keys[0].0, digest("acme-0123456789abcdef"));
    }

    #[test]
    fn keys_name_their_tenant() {
        let t = Tenants::from_toml(FILE).unwrap();
        assert_eq!(t.names(), ["acme", "beta"]);
        assert_eq!(
            t.authenticate(Some("Bearer acme-0123456789abcdef")),
            Ok(TenantId(0))
        );
        assert_eq!(
            t.authenticate(Some("Bearer beta-fedcba9876543210")),
            Ok(TenantId(1))
        );
        assert!(t
            .authenticate(Some("Bearer nope-0123456789abcdef"))
            .is_err());
        assert!(t.authenticate(Some("acme-0123456789abcdef")).is_err());
        assert!(t.authenticate(None).unwrap_err().0.contains("missing"));
        let c: Vec<_> = t.configs().collect();
        assert_eq!(c[0].1.weight, 3.0);
        assert_eq!(c[0].1.max_sessions, Some(4));
        assert_eq!(c[1].1.weight, 1.0);
        assert_eq!(Tenants::open().authenticate(None), Ok(TenantId(0)));
    }

    #[test]
    fn bad_files_say_what_is_wrong() {
        let e = |s: &str| Tenants::from_toml(s).unwrap_err().to_string();
        assert!(e("[[tenant]]\nname = \"a\"\nkeys = [\"short\"]").contains("at least 16"));
        assert!(e("[[tenant]]\nname = \"a\"\nkeys = []").contains("keys"));
        assert!(e(&format!(
            "{FILE}\n[[tenant]]\nname = \"acme\"\nkeys = [\"x123456789abcdefgh\"]"
        ))
        .contains("used twice"));
        assert!(
            e("[[tenant]]\nname = \"a\"\nkeys = [\"0123456789abcdefg\"]\nwieght = 2")
                .contains("wieght")
        );
        assert!(
            e("[[tenant]]\nname = \"a\"\nkeys = [\"0123456789abcdefg\"]\nweight = -1")
                .contains("weight")
        );
    }
}
