//! Start-up: the verifier core over an engine, its batcher thread, and the service in front.

use std::sync::Arc;

use tandem_verifier::{VerifierCore, VerifierError};

use super::{Service, ServiceInfo};
use crate::tenants::Tenants;
use crate::{Gauges, Reply};

/// Start the batcher thread over `engine` (a verifier core with `cfg`) and the service in front
/// of it, serving `tenants` (their weights and quotas are set on the core). The thread ends (and
/// hands back the core) when the service is dropped.
pub fn start(
    engine: tandem_engine::Engine,
    cfg: tandem_verifier::VerifierConfig,
    info: ServiceInfo,
    tenants: Tenants,
) -> Result<
    (
        Service,
        std::thread::JoinHandle<VerifierCore<tandem_engine::Engine, Reply>>,
    ),
    VerifierError,
> {
    start_with_ledger(engine, cfg, info, tenants, None)
}

/// [`start`], recording every ended session in `ledger` (see [`crate::ledger`]).
pub fn start_with_ledger(
    engine: tandem_engine::Engine,
    cfg: tandem_verifier::VerifierConfig,
    info: ServiceInfo,
    tenants: Tenants,
    ledger: Option<crate::ledger::Ledger>,
) -> Result<
    (
        Service,
        std::thread::JoinHandle<VerifierCore<tandem_engine::Engine, Reply>>,
    ),
    VerifierError,
> {
    // A verifier on the wire tells edges the largest γ and depth it grants: it needs them
    // (`serving_load`), not the core's default of whatever a session asks for.
    if cfg.load.max_draft_len == u32::MAX || cfg.load.max_depth == u32::MAX {
        return Err(VerifierError::Invalid(
            "load: a gRPC verifier needs its largest γ and depth (grpc::serving_load), not LoadConfig::FIXED's unbounded ones".into(),
        ));
    }
    // A block's forward feeds the last committed token, γ tokens and the side nodes: the
    // service checks a token tree's side nodes against what the forward's token budget holds.
    let load = cfg.load.within_budget(cfg.token_budget);
    let mut core = VerifierCore::new(engine, cfg, 0)?;
    if let Some(cost) = &load.forward_cost {
        core.set_contended_budget(cfg.contended_budget(cost))?;
    }
    for (id, cfg) in tenants.configs() {
        core.set_tenant(id, cfg)?;
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let gauges = Arc::new(Gauges::default());
    let g = gauges.clone();
    let names = tenants.names().to_vec();
    let batcher = std::thread::Builder::new()
        .name("tandem-batcher".into())
        .spawn(move || crate::run_batcher(core, rx, g, names, ledger))
        .map_err(|e| VerifierError::Engine(format!("starting the batcher: {e}")))?;
    Ok((
        Service::new(tx, info, load, gauges, Arc::new(tenants)),
        batcher,
    ))
}
