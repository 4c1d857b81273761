//! The bench's configuration: its own, or one given, rewritten so that nothing is ever
//! refused.

use super::*;

/// The bench's own configuration (the accounts' `base_url` is replaced by the mock's
/// address): two tenants on a plan with per-tier rates and a concurrency limit, all far
/// above what one machine can send, and two accounts.
pub const BENCH_CONFIG: &str = r#"
tiers = ["org", "user"]

[gateway]
max_request_tokens = 512
tenant_queue = 65536
queue = 65536
uploads_per_tenant = 65536
max_connections = 4096
embedding_models = ["mock-embedding-small"]
encodings = { "mock-embedding-small" = "cl100k_base" }

[upstream]
dimensions = 16
latency = "0s"

[plan.bench]
org = { rpm = 60000000, tpm = 300000000, concurrency = 65536 }
user = { rpm = 60000000, tpm = 300000000 }

[[tenant]]
name = "acme"
plan = "bench"
weight = 3

[[tenant.key]]
key = "sk-bench-acme"
user = "indexer"

[[tenant]]
name = "globex"
plan = "bench"
weight = 1

[[tenant.key]]
key = "sk-bench-globex"
user = "alice"

[[account]]
name = "primary"
base_url = "http://127.0.0.1:9"
api_key = "up-key-primary"
rpm = 60000000
tpm = 300000000
window = "1s"

[[account]]
name = "secondary"
base_url = "http://127.0.0.1:9"
api_key = "up-key-secondary"
rpm = 60000000
tpm = 300000000
window = "1s"
"#;

/// The requests a minute every account and plan tier gets in the bench: a million a
/// second, beyond any one machine.
pub(super) const BENCH_RPM: i64 = 60_000_000;
/// The tokens a minute every account and plan tier gets in the bench.
pub(super) const BENCH_TPM: i64 = 300_000_000;
/// Concurrency, queues, uploads and connections in the bench: never the bound.
pub(super) const BENCH_WIDE: i64 = 65_536;

/// The configuration the bench runs: its text, and what its load sends.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// The rewritten configuration (TOML).
    pub text: String,
    /// A plain-text API key of each tenant, for the gateway.
    pub tenant_keys: Vec<String>,
    /// Every account's upstream key, for the mock and the plain proxies.
    pub account_keys: Vec<String>,
    /// The embedding model asked for.
    pub model: String,
}

pub(super) fn table_mut<'a>(doc: &'a mut toml::Table, key: &str) -> Result<&'a mut toml::Table, String> {
    doc.entry(key.to_owned())
        .or_insert_with(|| toml::Value::Table(toml::Table::new()))
        .as_table_mut()
        .ok_or_else(|| format!("`{key}` is not a table"))
}

pub(super) fn array_of_tables<'a>(doc: &'a mut toml::Table, key: &str) -> Result<Vec<&'a mut toml::Table>, String> {
    match doc.get_mut(key) {
        None => Ok(Vec::new()),
        Some(toml::Value::Array(items)) => items
            .iter_mut()
            .map(|v| v.as_table_mut().ok_or_else(|| format!("`[[{key}]]` holds something else than tables")))
            .collect(),
        Some(_) => Err(format!("`{key}` is not an array of tables")),
    }
}

/// Rewrites the configuration `source` for the bench: every account's `base_url` becomes
/// `upstream` and its quotas 60M rpm and 300M tpm; every plan tier's rates
/// become those (their bursts the default), its concurrency 65,536; the queues,
/// uploads and connections are widened and the mock answers at once.
///
/// # Errors
/// `source` is not TOML, has no account or no tenant key in plain text, or the result
/// does not validate.
pub fn rewrite(source: &str, upstream: &str) -> Result<BenchConfig, String> {
    let mut doc: toml::Table = source.parse().map_err(|e| format!("the bench's configuration: {e}"))?;
    let gateway = table_mut(&mut doc, "gateway")?;
    for key in ["tenant_queue", "queue", "uploads_per_tenant", "max_connections"] {
        gateway.insert(key.to_owned(), toml::Value::Integer(BENCH_WIDE));
    }
    let model = match gateway.get("embedding_models") {
        Some(toml::Value::Array(models)) => models.first().and_then(toml::Value::as_str).map(str::to_owned),
        _ => None,
    }
    .unwrap_or_else(|| "mock-embedding-small".to_owned());
    table_mut(&mut doc, "upstream")?.insert("latency".to_owned(), toml::Value::String("0s".to_owned()));
    for (name, plan) in table_mut(&mut doc, "plan")?.iter_mut() {
        let plan = plan.as_table_mut().ok_or_else(|| format!("plan {name:?} is not a table"))?;
        for (tier, limits) in plan.iter_mut() {
            let limits = limits.as_table_mut().ok_or_else(|| format!("plan.{name}.{tier} is not a table"))?;
            for (key, value) in [("rpm", BENCH_RPM), ("tpm", BENCH_TPM), ("concurrency", BENCH_WIDE)] {
                if limits.contains_key(key) {
                    limits.insert(key.to_owned(), toml::Value::Integer(value));
                }
            }
            limits.remove("rpm_burst");
            limits.remove("tpm_burst");
        }
    }
    let mut account_keys = Vec::new();
    for account in array_of_tables(&mut doc, "account")? {
        account.insert("base_url".to_owned(), toml::Value::String(upstream.to_owned()));
        account.insert("rpm".to_owned(), toml::Value::Integer(BENCH_RPM));
        account.insert("tpm".to_owned(), toml::Value::Integer(BENCH_TPM));
        if let Some(key) = account.get("api_key").and_then(toml::Value::as_str) {
            account_keys.push(key.to_owned());
        }
    }
    let mut tenant_keys = Vec::new();
    for tenant in array_of_tables(&mut doc, "tenant")? {
        let first = array_of_tables(tenant, "key")?
            .into_iter()
            .find_map(|k| k.get("key").and_then(toml::Value::as_str).map(str::to_owned));
        tenant_keys.extend(first);
    }
    if account_keys.is_empty() {
        return Err("the bench's configuration has no [[account]]".into());
    }
    if tenant_keys.is_empty() {
        return Err("the bench needs a tenant's API key in plain text (`key = \"...\"`) in its configuration".into());
    }
    let text = toml::to_string(&doc).map_err(|e| format!("cannot write the bench's configuration: {e}"))?;
    Config::parse(&text, Some("the bench's configuration")).map_err(|e| e.to_string())?;
    Ok(BenchConfig { text, tenant_keys, account_keys, model })
}
