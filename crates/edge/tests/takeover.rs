//! A saturated verifier takes a speculation session over — grants it γ 0 and decodes every token
//! itself, verifying none of its blocks — and later hands it back; the real edge runtime follows
//! along (drafting paused and resumed, blocks in flight matched against the decoded tokens) and
//! commits exactly the target's greedy output. Tiny random model, real verifier and scheduler,
//! real pipeline.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use tandem_bench::synthetic::SyntheticDrafter;
use tandem_edge::{EdgeError, Link, SpecConfig};
use tandem_engine::testing::{tiny_file, TinySpec};
use tandem_engine::{Engine, EngineConfig, LlamaModel, WeightMode};
use tandem_sched::{SessionId, TenantId};
use tandem_spec::sampling::SamplingParams;
use tandem_spec::Incoming;
use tandem_spec::{Block, VerifyRule};
use tandem_verifier::{Event, VerifierConfig, VerifierCore};

const SESSION: u64 = 7;

fn verifier() -> VerifierCore {
    let mut f = tiny_file(&TinySpec::default()).unwrap();
    let m = Arc::new(LlamaModel::load(&mut f, WeightMode::F32).unwrap());
    let e = Engine::new(
        m,
        EngineConfig {
            threads: 1,
            kv_budget_bytes: 1 << 20,
            kv_block_size: 4,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    VerifierCore::new(e, VerifierConfig::default()).unwrap()
}

/// The verifier behind a link that takes the session over after `take_after` verdicts and hands
/// it back after `give_after` decoded tokens.
struct Local {
    v: VerifierCore,
    inbox: VecDeque<Incoming>,
    verdicts: usize,
    decoded: usize,
    take_after: usize,
    give_after: usize,
    taken: bool,
    giving: bool,
    handed_back: bool,
    /// The grant to tell with the next decoded token.
    tell: Option<tandem_spec::Shape>,
    decoded_at_takeover: usize,
}

impl Local {
    fn absorb(&mut self, events: Vec<Event>) -> Result<(), EdgeError> {
        for e in events {
            match e {
                Event::Verdict { verdict, .. } => {
                    self.verdicts += 1;
                    self.inbox.push_back(Incoming::Verdict(verdict));
                }
                Event::Decoded { mut decoded, .. } => {
                    self.decoded += 1;
                    // The grant the core's turn would attach: γ 0 once taken over, the grant
                    // again once handed back.
                    decoded.grant = self.tell.take();
                    if decoded.grant.is_some_and(|g| g.draft_len > 0) {
                        self.handed_back = true;
                    }
                    self.inbox.push_back(Incoming::Decoded(decoded));
                }
                Event::Error { error, .. } => return Err(EdgeError::Refused(error.to_string())),
                _ => {}
            }
        }
        if !self.taken && self.verdicts >= self.take_after {
            self.taken = true;
            self.tell = Some(tandem_spec::Shape::new(0, 1));
            self.decoded_at_takeover = self.decoded;
            let e = self.v.set_takeover(SessionId(SESSION), true);
            self.absorb(e)?;
        }
        if self.taken && !self.giving && self.decoded >= self.decoded_at_takeover + self.give_after
        {
            self.giving = true;
            self.tell = Some(tandem_spec::Shape::new(3, 2));
            let e = self.v.set_takeover(SessionId(SESSION), false);
            self.absorb(e)?;
        }
        Ok(())
    }
}

impl Link for Local {
    fn send(&mut self, block: Block) -> Result<(), EdgeError> {
        let e = self.v.draft(SessionId(SESSION), block);
        self.absorb(e)
    }

    fn ack(&mut self, committed: usize) -> Result<(), EdgeError> {
        let e = self.v.ack(SessionId(SESSION), committed);
        self.absorb(e)
    }

    fn recv(&mut self, wait: bool) -> Result<Option<Incoming>, EdgeError> {
        while wait && self.inbox.is_empty() && self.v.has_work() {
            let e = self.v.step(0);
            self.absorb(e)?;
        }
        Ok(self.inbox.pop_front())
    }
}

#[test]
fn a_session_taken_over_and_handed_back_is_the_targets() {
    let prompt: Vec<u32> = (0..8).map(|i| (i * 11 + 5) % 90).collect();
    let n = 40;
    // The target's own greedy answer: a cloud-only generation on the same verifier.
    let mut v = verifier();
    v.open_generation(
        SessionId(1),
        TenantId(0),
        &prompt,
        SamplingParams::default(),
        n,
        vec![],
    )
    .unwrap();
    let want: Vec<u32> = v
        .run_until_idle(0)
        .into_iter()
        .filter_map(|e| match e {
            Event::Token { token, .. } => Some(token),
            _ => None,
        })
        .collect();
    assert_eq!(want.len(), n);
    for (take_after, give_after, alpha, depth) in [(2, 5, 0.7, 2), (1, 1, 0.5, 3), (4, 12, 0.9, 1)]
    {
        v.open(
            SessionId(SESSION),
            TenantId(0),
            &prompt,
            SamplingParams::default(),
            VerifyRule::Greedy,
            n,
            vec![],
        )
        .unwrap();
        // One forward prefills the prompt (and plans the first decode).
        let first = v
            .step(0)
            .into_iter()
            .find_map(|e| match e {
                Event::Opened { first, .. } => Some(first),
                _ => None,
            })
            .unwrap();
        let mut link = Local {
            v,
            inbox: VecDeque::new(),
            verdicts: 0,
            decoded: 0,
            take_after,
            give_after,
            taken: false,
            giving: false,
            handed_back: false,
            tell: None,
            decoded_at_takeover: 0,
        };
        let cfg = SpecConfig {
            session: tandem_spec::edge::SessionConfig {
                draft_len: 3,
                depth,
                max_new_tokens: n,
                auto: None,
                tree: tandem_spec::TreeConfig::LINEAR,
            },
            rule: VerifyRule::Greedy,
            params: SamplingParams::default(),
            q_top_k: 0,
        };
        let mut d = SyntheticDrafter::new(prompt.len(), want.clone(), alpha, 0.0, 96, 3);
        let r = tandem_edge::run_with(
            &mut d,
            vec![],
            &prompt,
            // (No grant: as the in-process verifier grants whatever is asked.)
            Some(tandem_spec::Opened {
                first,
                grant: tandem_spec::Shape::UNLIMITED,
                side_nodes: usize::MAX,
            }),
            &cfg,
            &mut link,
            Instant::now(),
            |_| {},
        )
        .unwrap();
        assert_eq!(
            r.output_ids, want,
            "take after {take_after}, give after {give_after}"
        );
        assert!(
            link.taken && link.handed_back,
            "it was taken over and handed back"
        );
        assert!(r.measured.cloud_decoded >= give_after, "{:?}", r.measured);
        println!(
            "take after {take_after} verdicts, hand back after {give_after}: {} decoded by the verifier, {} verdicts in all, {} stale blocks",
            link.decoded, link.verdicts, r.stats.stale_blocks
        );
        v = link.v;
        v.close(SessionId(SESSION));
    }
}
