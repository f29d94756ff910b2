//! Where a batch's files live: a local folder or an object-store URL
//! (`s3://`, `gs://`, `az://`, `file://`), through the `object_store` crate
//! (the one arrow-rs, polars and DataFusion use). Credentials and
//! endpoints come from the standard environment variables of each store
//! (`AWS_ACCESS_KEY_ID`, `AWS_ENDPOINT_URL`,
//! `GOOGLE_APPLICATION_CREDENTIALS`, `AZURE_STORAGE_ACCOUNT_NAME`, …; see
//! the README).
//!
//! A [`Location`] is a root: files under it are named by `/`-separated
//! relative keys. Writes are atomic (a local file is written beside its
//! name and renamed; an object appears whole when its upload completes), so
//! a reader never sees half a file.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use futures::TryStreamExt;
use object_store::path::Path as Key;
use object_store::{ObjectStore, ObjectStoreExt, ObjectStoreScheme, PutPayload, RetryConfig};

/// A local folder or an object-store prefix.
#[derive(Clone, Debug)]
pub struct Location {
    store: Arc<dyn ObjectStore>,
    prefix: Key,
    /// As the user wrote it, for messages.
    shown: String,
    /// The folder, when local.
    local: Option<PathBuf>,
    /// Said after a failure when the environment names no credentials for
    /// the store (it then falls back to the machine's identity: instance
    /// metadata, and the like).
    hint: Option<&'static str>,
}

/// Whether gcloud's application-default credentials file exists (object_store
/// reads it when no variable names credentials).
fn gcloud_default_credentials() -> bool {
    std::env::var_os("HOME")
        .map(PathBuf::from)
        .is_some_and(|h| h.join(".config/gcloud/application_default_credentials.json").is_file())
}

/// What to say when a store's request fails and the environment names no
/// credentials for it: None when it names some.
fn credentials_hint(scheme: &ObjectStoreScheme) -> Option<&'static str> {
    let any = |vars: &[&str]| vars.iter().any(|v| std::env::var_os(v).is_some_and(|x| !x.is_empty()));
    match scheme {
        ObjectStoreScheme::AmazonS3 => (!any(&[
            "AWS_ACCESS_KEY_ID",
            "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
            "AWS_CONTAINER_CREDENTIALS_FULL_URI",
            "AWS_WEB_IDENTITY_TOKEN_FILE",
            "AWS_SKIP_SIGNATURE",
        ]))
        .then_some(
            "no AWS credentials in the environment, so the instance-metadata service was asked for them: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or run where an instance role is attached)",
        ),
        ObjectStoreScheme::GoogleCloudStorage => (!any(&[
            "GOOGLE_SERVICE_ACCOUNT",
            "GOOGLE_SERVICE_ACCOUNT_PATH",
            "GOOGLE_SERVICE_ACCOUNT_KEY",
            "GOOGLE_APPLICATION_CREDENTIALS",
        ]) && !gcloud_default_credentials())
        .then_some(
            "no Google credentials in the environment, so the metadata server was asked for them: set GOOGLE_APPLICATION_CREDENTIALS (or GOOGLE_SERVICE_ACCOUNT)",
        ),
        ObjectStoreScheme::MicrosoftAzure => (!any(&[
            "AZURE_STORAGE_ACCOUNT_KEY",
            "AZURE_STORAGE_ACCESS_KEY",
            "AZURE_STORAGE_SAS_KEY",
            "AZURE_STORAGE_SAS_TOKEN",
            "AZURE_CLIENT_SECRET",
            "AZURE_FEDERATED_TOKEN_FILE",
            "AZURE_STORAGE_USE_EMULATOR",
            "AZURE_STORAGE_TOKEN",
            "AZURE_USE_AZURE_CLI",
            "AZURE_SKIP_SIGNATURE",
        ]))
        .then_some(
            "no Azure credentials in the environment, so the managed identity was asked for them: set AZURE_STORAGE_ACCOUNT_KEY (or a SAS token, or a service principal)",
        ),
        _ => None,
    }
}

/// True when `s` names an object-store URL rather than a local path.
pub fn is_url(s: &str) -> bool {
    s.split_once("://").is_some_and(|(scheme, _)| {
        !scheme.is_empty() && scheme.chars().all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
    })
}

impl Location {
    /// Opens `s`: a URL, or a local folder (created when `create`).
    pub fn open(s: &str, create: bool) -> Result<Location> {
        if !is_url(s) {
            return Location::local(Path::new(s), create);
        }
        let url = url::Url::parse(s).with_context(|| format!("{s}: not a valid URL"))?;
        let (scheme, prefix) = ObjectStoreScheme::parse(&url)
            .map_err(|_| anyhow!("{s}: unsupported URL (use s3://, gs://, az:// or file://)"))?;
        // Fail fast on an unreachable store instead of object_store's default
        // of ten retries over three minutes. (Client options are left to the
        // environment: AWS_ALLOW_HTTP, timeouts, proxies.)
        let retry = RetryConfig { max_retries: 2, retry_timeout: Duration::from_secs(20), ..Default::default() };
        let bad = |e: object_store::Error| anyhow!("{s}: {e}");
        let store: Arc<dyn ObjectStore> = match &scheme {
            ObjectStoreScheme::Local => {
                let path = url.to_file_path().map_err(|()| anyhow!("{s}: not a local file URL"))?;
                return Location::local(&path, create);
            }
            ObjectStoreScheme::AmazonS3 => Arc::new(
                object_store::aws::AmazonS3Builder::from_env().with_url(s).with_retry(retry).build().map_err(bad)?,
            ),
            ObjectStoreScheme::GoogleCloudStorage => Arc::new(
                object_store::gcp::GoogleCloudStorageBuilder::from_env()
                    .with_url(s)
                    .with_retry(retry)
                    .build()
                    .map_err(bad)?,
            ),
            ObjectStoreScheme::MicrosoftAzure => Arc::new(
                object_store::azure::MicrosoftAzureBuilder::from_env()
                    .with_url(s)
                    .with_retry(retry)
                    .build()
                    .map_err(bad)?,
            ),
            _ => bail!("{s}: unsupported URL (use s3://, gs://, az:// or file://)"),
        };
        Ok(Location {
            store,
            prefix,
            shown: s.trim_end_matches('/').to_string(),
            local: None,
            hint: credentials_hint(&scheme),
        })
    }

    fn local(dir: &Path, create: bool) -> Result<Location> {
        if create {
            std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        } else if !dir.is_dir() {
            bail!("{}: no such folder", dir.display());
        }
        let abs = std::path::absolute(dir).with_context(|| format!("{}: bad path", dir.display()))?;
        let store = object_store::local::LocalFileSystem::new_with_prefix(&abs)
            .with_context(|| format!("cannot open {}", dir.display()))?;
        Ok(Location {
            store: Arc::new(store),
            prefix: Key::default(),
            shown: dir.display().to_string(),
            local: Some(dir.to_path_buf()),
            hint: None,
        })
    }

    /// The folder, when the location is local.
    pub fn local_dir(&self) -> Option<&Path> {
        self.local.as_deref()
    }

    /// `rel` under this location, as shown to the user.
    pub fn show(&self, rel: &str) -> String {
        if rel.is_empty() { self.shown.clone() } else { format!("{}/{rel}", self.shown) }
    }

    /// The object_store path of `rel`. A remote store's keys are taken as
    /// they are (an S3 key may hold `[`, `%` or spaces, and must be asked
    /// for verbatim); a local folder's are percent-encoded, which is how
    /// object_store names files with such characters.
    fn key(&self, rel: &str) -> Key {
        let parts = rel.split('/').filter(|p| !p.is_empty());
        if self.local.is_none() {
            let raw: Vec<&str> =
                self.prefix.as_ref().split('/').filter(|p| !p.is_empty()).chain(parts.clone()).collect();
            if let Ok(key) = Key::parse(raw.join("/")) {
                return key;
            }
        }
        parts.fold(self.prefix.clone(), |k, p| k.clone().join(p))
    }

    /// The error of a failed request: what, where, object_store's reason,
    /// and the credentials hint where the environment names none.
    fn failed(&self, verb: &str, rel: &str, e: &object_store::Error) -> anyhow::Error {
        let why = brief(e);
        match self.hint {
            Some(hint) if !matches!(e, object_store::Error::NotFound { .. }) => {
                anyhow!("cannot {verb} {}: {why} ({hint})", self.show(rel))
            }
            _ => anyhow!("cannot {verb} {}: {why}", self.show(rel)),
        }
    }

    /// Writes `bytes` to `rel`, replacing what was there.
    pub fn put(&self, rel: &str, bytes: Vec<u8>) -> Result<()> {
        let key = self.key(rel);
        block_on(self.store.put(&key, PutPayload::from(bytes))).map_err(|e| self.failed("write", rel, &e))?;
        Ok(())
    }

    /// Reads `rel` whole.
    pub fn get(&self, rel: &str) -> Result<Vec<u8>> {
        let key = self.key(rel);
        let bytes =
            block_on(async { self.store.get(&key).await?.bytes().await }).map_err(|e| self.failed("read", rel, &e))?;
        Ok(bytes.to_vec())
    }

    /// Deletes `rel`; a missing file is not an error.
    pub fn delete(&self, rel: &str) -> Result<()> {
        let key = self.key(rel);
        match block_on(self.store.delete(&key)) {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.failed("delete", rel, &e)),
        }
    }

    /// Every file under `rel` (recursively), as keys relative to this
    /// location, sorted. A missing folder lists as empty.
    pub fn list(&self, rel: &str) -> Result<Vec<String>> {
        Ok(self.list_modified(rel)?.into_iter().map(|k| k.0).collect())
    }

    /// [`Location::list`] with each file's last modification.
    pub fn list_modified(&self, rel: &str) -> Result<Vec<(String, std::time::SystemTime)>> {
        let base = self.key(rel);
        // LocalFileSystem refuses to list a folder that does not exist.
        if let Some(dir) = &self.local
            && !dir.join(rel).is_dir()
        {
            return Ok(Vec::new());
        }
        let metas: Vec<object_store::ObjectMeta> =
            block_on(self.store.list(Some(&base)).try_collect()).map_err(|e| self.failed("list", rel, &e))?;
        let mut keys: Vec<(String, std::time::SystemTime)> = metas
            .into_iter()
            .filter_map(|m| {
                // A local file's parts come back percent-encoded, and `key`
                // encodes them again; a remote key comes back verbatim.
                let parts: Vec<String> = m
                    .location
                    .prefix_match(&self.prefix)?
                    .map(|p| match self.local {
                        Some(_) => percent_encoding::percent_decode_str(p.as_ref()).decode_utf8_lossy().into_owned(),
                        None => p.as_ref().to_string(),
                    })
                    .collect();
                Some((parts.join("/"), std::time::SystemTime::from(m.last_modified)))
            })
            .collect();
        keys.sort();
        Ok(keys)
    }
}

/// The first line of an object_store error, without its debug chain.
fn brief(e: &object_store::Error) -> String {
    let mut s = e.to_string();
    if let Some(src) = std::error::Error::source(e) {
        let src = src.to_string();
        if !s.contains(&src) {
            s = format!("{s} ({src})");
        }
    }
    s
}

/// Runs a future on the one runtime of the process (object_store is
/// async; the rest of fragscope is not).
fn block_on<F: std::future::Future>(f: F) -> F::Output {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME
        .get_or_init(|| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .thread_name("fragscope-io")
                .enable_all()
                .build()
                .expect("cannot start the I/O runtime")
        })
        .block_on(f)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_and_paths_are_told_apart() {
        assert!(is_url("s3://bucket/prefix"));
        assert!(is_url("file:///tmp/x"));
        assert!(!is_url("/tmp/x"));
        assert!(!is_url("runs/a://b"));
        assert!(!is_url("C:\\runs"));
    }

    #[test]
    fn file_urls_are_decoded() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("my out");
        let url = url::Url::from_file_path(&dir).unwrap();
        let loc = Location::open(url.as_str(), true).unwrap();
        loc.put("f", b"1".to_vec()).unwrap();
        assert!(dir.join("f").is_file(), "{url}");
    }

    #[test]
    fn a_local_location_puts_lists_and_deletes() {
        let tmp = tempfile::tempdir().unwrap();
        let loc = Location::open(tmp.path().join("out").to_str().unwrap(), true).unwrap();
        loc.put("a/b/part-0-of-2.parquet", b"x".to_vec()).unwrap();
        loc.put("a/c.txt", b"yz".to_vec()).unwrap();
        // A name object_store percent-encodes on disk lists back as written.
        loc.put("x#y [1].txt", b"o".to_vec()).unwrap();
        assert!(loc.list("").unwrap().contains(&"x#y [1].txt".to_string()));
        assert_eq!(loc.get("x#y [1].txt").unwrap(), b"o");
        loc.delete("x#y [1].txt").unwrap();
        assert_eq!(loc.list("a").unwrap(), vec!["a/b/part-0-of-2.parquet", "a/c.txt"]);
        assert_eq!(loc.list("missing").unwrap(), Vec::<String>::new());
        assert_eq!(loc.get("a/c.txt").unwrap(), b"yz");
        loc.delete("a/c.txt").unwrap();
        loc.delete("a/c.txt").unwrap();
        assert_eq!(loc.list("").unwrap(), vec!["a/b/part-0-of-2.parquet"]);
        let err = loc.get("a/c.txt").unwrap_err().to_string();
        assert!(err.contains("a/c.txt"), "{err}");
    }
}
