//! Real gRPC verifiers on loopback ports, in-process, serving SmolLM2's f32 target; the edge's Open
//! for a greedy session; two tenants with API keys. Besides the verifier server's own tests, the
//! edge's tests and the binary's include this file by path: `tandem-testkit` cannot hold it,
//! since it would link `tandem-cloud`, whose tests depend on the testkit.
#![allow(dead_code)]

use std::sync::{Arc, OnceLock};
use std::time::Duration;

pub use tandem_testkit::*;

use tandem_cloud::tenants::Tenants;
use tandem_engine::{Engine, EngineConfig};

/// A greedy session's Open over `prompt`: 16 tokens, γ 4, depth 2, linear blocks, no API key
/// (tests change what they need with `..`).
pub fn greedy_open(fingerprint: &str, prompt: &[u32]) -> tandem_edge::grpc::OpenRequest {
    tandem_edge::grpc::OpenRequest {
        tokenizer_fingerprint: fingerprint.to_string(),
        prompt_ids: prompt.to_vec(),
        params: tandem_spec::sampling::SamplingParams::default(),
        max_tokens: 16,
        rule: tandem_spec::VerifyRule::Greedy,
        want_draft_len: 4,
        want_depth: 2,
        want_side_nodes: 0,
        api_key: None,
        tls_ca: None,
        route: None,
        grammar: None,
        output_from: None,
        logprobs: None,
        self_draft: true,
    }
}

/// A verifier with these tenants, scheduler settings and KV cache size; with `pace`, it measures
/// its forward cost first and takes slow speculation sessions over on their own.
pub fn grpc_server_with(
    saturation_tokens: f64,
    pace: bool,
    tenants: Tenants,
    cfg: tandem_verifier::VerifierConfig,
    kv_budget_bytes: usize,
) -> (String, Arc<tandem_cloud::Gauges>) {
    let (m, tok) = target();
    let served = (m, tok, "SmolLM2-135M-Instruct");
    grpc_server_of(
        served,
        saturation_tokens,
        pace,
        tenants,
        cfg,
        kv_budget_bytes,
    )
}

/// [`grpc_server_with`] serving another model: `(target, its tokenizer, its name)`.
pub fn grpc_server_of(
    (m, tok, name): (
        &Arc<tandem_engine::LlamaModel>,
        &tandem_engine::Tokenizer,
        &str,
    ),
    saturation_tokens: f64,
    pace: bool,
    tenants: Tenants,
    cfg: tandem_verifier::VerifierConfig,
    kv_budget_bytes: usize,
) -> (String, Arc<tandem_cloud::Gauges>) {
    let mut engine = Engine::new(
        m.clone(),
        EngineConfig {
            threads: 1,
            kv_budget_bytes,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    let forward_cost = pace.then(|| {
        tandem_cloud::measure_forward_cost(&mut engine, &tandem_cloud::CALIBRATION_SIZES, 3)
            .unwrap()
            .1
    });
    let info = tandem_cloud::grpc::ServiceInfo::new(name, m, tok);
    let cfg = tandem_verifier::VerifierConfig {
        load: tandem_verifier::LoadConfig {
            saturation_tokens,
            forward_cost,
            // A test's own idle timeout, else the served default.
            idle_timeout_ms: cfg
                .load
                .idle_timeout_ms
                .or(Some(tandem_cloud::grpc::IDLE_TIMEOUT_MS)),
            ..tandem_cloud::grpc::serving_load(8, 4)
        },
        ..cfg
    };
    let (service, _batcher) = tandem_cloud::grpc::start(engine, cfg, info, tenants).unwrap();
    let gauges = service.gauges();
    let addr = on_loopback(move |l| async move {
        tandem_cloud::grpc::serve_grpc(service, l, std::future::pending(), Duration::ZERO)
            .await
            .unwrap();
    });
    (format!("http://{addr}"), gauges)
}

/// A verifier of its own (open to every tenant, default settings, a 256 MiB KV cache), for a
/// test that reads the server's load or holds its sessions: its URL and its gauges.
pub fn new_grpc_server(saturation_tokens: f64) -> (String, Arc<tandem_cloud::Gauges>) {
    grpc_server_with(
        saturation_tokens,
        false,
        Tenants::open(),
        tandem_verifier::VerifierConfig::default(),
        256 << 20,
    )
}

/// A real gRPC verifier on a loopback port, serving the f32 target, shared by the tests of one
/// test binary; returns its URL.
pub fn grpc_server() -> &'static String {
    static URL: OnceLock<String> = OnceLock::new();
    URL.get_or_init(|| new_grpc_server(tandem_cloud::grpc::DEFAULT_SATURATION_TOKENS).0)
}

/// How long a verifier of these tests waits for a session's next block before decoding a token
/// alone: longer than the slowest draft here takes for a block (8 tokens at 0.23 s on a busy
/// AVX2 machine on the portable kernels).
pub const AWAIT_DRAFTS_MS: u64 = 5_000;

/// [`grpc_server`] that awaits its edges' blocks (`--await-drafts-ms`): it verifies every block
/// and decodes no speculating session alone while its draft keeps up, so a test of what happens
/// to drafts sees them judged however slow the draft is beside the target (on a CPU where the
/// 4-bit draft is slower than the f32 target, the default verifier decodes every token before a
/// block lands).
pub fn awaiting_server() -> &'static String {
    static URL: OnceLock<String> = OnceLock::new();
    URL.get_or_init(|| new_awaiting_server().0)
}

/// A new verifier that awaits its edges' blocks (see [`awaiting_server`]): its URL and gauges.
pub fn new_awaiting_server() -> (String, Arc<tandem_cloud::Gauges>) {
    let (m, tok) = target();
    awaiting_server_of((m, tok, "SmolLM2-135M-Instruct"))
}

/// [`new_awaiting_server`] serving another model: `(target, its tokenizer, its name)`.
pub fn awaiting_server_of(
    served: (
        &Arc<tandem_engine::LlamaModel>,
        &tandem_engine::Tokenizer,
        &str,
    ),
) -> (String, Arc<tandem_cloud::Gauges>) {
    grpc_server_of(
        served,
        tandem_cloud::grpc::DEFAULT_SATURATION_TOKENS,
        false,
        Tenants::open(),
        tandem_verifier::VerifierConfig {
            await_drafts_ms: AWAIT_DRAFTS_MS,
            ..tandem_verifier::VerifierConfig::default()
        },
        256 << 20,
    )
}

/// Tenant a's API key (see [`tenants`]).
pub const KEY_A: &str = "tenant-a-0123456789abcdef";
/// Tenant b's API key (see [`tenants`]).
pub const KEY_B: &str = "tenant-b-0123456789abcdef";

/// Two tenants, `a` (key [`KEY_A`]) and `b` (key [`KEY_B`]), with `extra` lines of the tenants
/// file after theirs (the last tenant's settings: `b`'s).
pub fn tenants(extra: &str) -> Tenants {
    Tenants::from_toml(&format!(
        "[[tenant]]\nname = \"a\"\nkeys = [\"{KEY_A}\"]\n\n\
         [[tenant]]\nname = \"b\"\nkeys = [\"{KEY_B}\"]\n{extra}"
    ))
    .unwrap()
}
