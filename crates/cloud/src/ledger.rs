//! The usage ledger: one row per ended session — its tenant, when it opened and closed, and its
//! counts (prompt tokens and, of them, those the prefix cache served, committed tokens, verified positions, accepted draft tokens, the
//! verifier's own tokens and, of them, decoded ones, the reason it ended) — in SQLite (embedded,
//! bundled). Counts, never content: no token, no text.
//!
//! Written off the hot path: the batcher hands each session's [`Usage`] to a [`Ledger`], which
//! passes it to a writer thread over a bounded queue without ever waiting. The writer takes
//! whatever has arrived and commits it in one transaction, so a slow disk costs batching, not
//! forward passes. When the queue is full the ledger coalesces rows per tenant (one row for many
//! sessions, `sessions` counting them) until the writer has room: a row may lose its own times,
//! never its counts. Dropping the ledger flushes what it holds and waits for the writer.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::thread::JoinHandle;

use rusqlite::{params, Connection};
use serde::Serialize;
use tandem_verifier::Usage;

/// Rows the writer's queue holds before the ledger coalesces.
pub const QUEUE: usize = 4096;

/// One row: a session, or (`sessions` > 1) several of one tenant coalesced.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Row {
    pub tenant: String,
    /// The session's id on its verifier (None for a coalesced row).
    pub session: Option<u64>,
    pub sessions: u64,
    pub speculative: bool,
    /// Unix time in ms (a coalesced row: its first open and last close).
    pub opened_ms: i64,
    pub closed_ms: i64,
    pub prompt_tokens: u64,
    /// Of its prompt tokens, those the prefix cache served (not computed).
    pub cached_prompt_tokens: u64,
    pub committed_tokens: u64,
    pub verified_positions: u64,
    pub accepted_draft_tokens: u64,
    pub cloud_tokens: u64,
    pub decoded_tokens: u64,
    /// Why it ended (a coalesced row: `coalesced`).
    pub finish_reason: String,
}

impl Row {
    /// The row of `u`, whose tenant is named `tenant`, with the driver's clock (µs) at
    /// `epoch_ms` in Unix time.
    pub fn of(u: &Usage, tenant: &str, epoch_ms: i64) -> Self {
        let ms = |us: u64| epoch_ms + (us / 1000) as i64;
        Row {
            tenant: tenant.to_string(),
            session: Some(u.session.0),
            sessions: 1,
            speculative: u.speculative,
            opened_ms: ms(u.opened_us),
            closed_ms: ms(u.closed_us),
            prompt_tokens: u.prompt_tokens as u64,
            cached_prompt_tokens: u.cached_tokens as u64,
            committed_tokens: u.committed_tokens as u64,
            verified_positions: u.verified_positions,
            accepted_draft_tokens: u.accepted_draft_tokens as u64,
            cloud_tokens: u.cloud_tokens as u64,
            decoded_tokens: u.decoded_tokens as u64,
            finish_reason: u.finish.as_str().to_string(),
        }
    }

    /// Fold `r` (the same tenant's) into this one.
    fn absorb(&mut self, r: &Row) {
        self.session = None;
        self.sessions += r.sessions;
        self.speculative |= r.speculative;
        self.opened_ms = self.opened_ms.min(r.opened_ms);
        self.closed_ms = self.closed_ms.max(r.closed_ms);
        self.prompt_tokens += r.prompt_tokens;
        self.cached_prompt_tokens += r.cached_prompt_tokens;
        self.committed_tokens += r.committed_tokens;
        self.verified_positions += r.verified_positions;
        self.accepted_draft_tokens += r.accepted_draft_tokens;
        self.cloud_tokens += r.cloud_tokens;
        self.decoded_tokens += r.decoded_tokens;
        self.finish_reason = "coalesced".into();
    }
}

/// What the ledger can fail with.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    #[error("the usage ledger at {path}: {source}")]
    Open {
        path: String,
        source: rusqlite::Error,
    },
    #[error("the usage ledger: {0}")]
    Sql(#[from] rusqlite::Error),
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS sessions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    tenant TEXT NOT NULL,
    session INTEGER,
    sessions INTEGER NOT NULL,
    speculative INTEGER NOT NULL,
    opened_ms INTEGER NOT NULL,
    closed_ms INTEGER NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    committed_tokens INTEGER NOT NULL,
    verified_positions INTEGER NOT NULL,
    accepted_draft_tokens INTEGER NOT NULL,
    cloud_tokens INTEGER NOT NULL,
    decoded_tokens INTEGER NOT NULL,
    finish_reason TEXT NOT NULL,
    cached_prompt_tokens INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS sessions_by_tenant ON sessions (tenant, closed_ms);
";

/// Columns added since the first schema, each with its default for the rows written before it:
/// a ledger from an older verifier gains them when opened, its rows kept.
const ADDED_COLUMNS: [(&str, &str); 1] = [("cached_prompt_tokens", "INTEGER NOT NULL DEFAULT 0")];

/// Open (creating it if need be) the ledger at `path`.
pub fn open(path: &Path) -> Result<Connection, LedgerError> {
    let err = |source| LedgerError::Open {
        path: path.display().to_string(),
        source,
    };
    let c = Connection::open(path).map_err(err)?;
    // Another process reading the file (`cloud usage`) waits, and is waited for.
    c.busy_timeout(std::time::Duration::from_secs(30))
        .map_err(err)?;
    c.pragma_update(None, "journal_mode", "WAL").map_err(err)?;
    c.pragma_update(None, "synchronous", "NORMAL")
        .map_err(err)?;
    c.execute_batch(SCHEMA).map_err(err)?;
    let have: Vec<String> = c
        .prepare("SELECT name FROM pragma_table_info('sessions')")
        .and_then(|mut q| q.query_map([], |r| r.get(0))?.collect())
        .map_err(err)?;
    for (name, kind) in ADDED_COLUMNS {
        if !have.iter().any(|h| h == name) {
            c.execute_batch(&format!("ALTER TABLE sessions ADD COLUMN {name} {kind}"))
                .map_err(err)?;
        }
    }
    Ok(c)
}

/// Write `rows` in one transaction.
pub fn write(c: &mut Connection, rows: &[Row]) -> Result<(), LedgerError> {
    let tx = c.transaction()?;
    {
        let mut ins = tx.prepare_cached(
            "INSERT INTO sessions (tenant, session, sessions, speculative, opened_ms, closed_ms,
             prompt_tokens, committed_tokens, verified_positions, accepted_draft_tokens,
             cloud_tokens, decoded_tokens, finish_reason, cached_prompt_tokens)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14)",
        )?;
        for r in rows {
            ins.execute(params![
                r.tenant,
                r.session.map(|s| s as i64),
                r.sessions as i64,
                r.speculative,
                r.opened_ms,
                r.closed_ms,
                r.prompt_tokens as i64,
                r.committed_tokens as i64,
                r.verified_positions as i64,
                r.accepted_draft_tokens as i64,
                r.cloud_tokens as i64,
                r.decoded_tokens as i64,
                r.finish_reason,
                r.cached_prompt_tokens as i64,
            ])?;
        }
    }
    tx.commit()?;
    Ok(())
}

/// A tenant's totals over the rows of a period.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Totals {
    pub tenant: String,
    pub sessions: u64,
    pub prompt_tokens: u64,
    pub cached_prompt_tokens: u64,
    pub committed_tokens: u64,
    pub verified_positions: u64,
    pub accepted_draft_tokens: u64,
    pub cloud_tokens: u64,
    pub decoded_tokens: u64,
}

/// Per-tenant totals of the sessions closed at or after `since_ms` (Unix ms), of `tenant` alone
/// when given, by tenant name.
pub fn totals(
    c: &Connection,
    tenant: Option<&str>,
    since_ms: i64,
) -> Result<Vec<Totals>, LedgerError> {
    let mut q = c.prepare(
        "SELECT tenant, SUM(sessions), SUM(prompt_tokens), SUM(committed_tokens),
         SUM(verified_positions), SUM(accepted_draft_tokens), SUM(cloud_tokens),
         SUM(decoded_tokens), SUM(cached_prompt_tokens)
         FROM sessions WHERE closed_ms >= ?1 AND (?2 IS NULL OR tenant = ?2)
         GROUP BY tenant ORDER BY tenant",
    )?;
    let rows = q.query_map(params![since_ms, tenant], |r| {
        let n = |i| r.get::<_, i64>(i).map(|x| x as u64);
        Ok(Totals {
            tenant: r.get(0)?,
            sessions: n(1)?,
            prompt_tokens: n(2)?,
            committed_tokens: n(3)?,
            verified_positions: n(4)?,
            accepted_draft_tokens: n(5)?,
            cloud_tokens: n(6)?,
            decoded_tokens: n(7)?,
            cached_prompt_tokens: n(8)?,
        })
    })?;
    Ok(rows.collect::<Result<_, _>>()?)
}

/// The batcher's side of the ledger: hands rows to the writer thread, never waiting for it.
pub struct Ledger {
    tx: Option<SyncSender<Row>>,
    /// Rows that found the queue full, coalesced per tenant, sent as room comes.
    held: BTreeMap<String, Row>,
    writer: Option<JoinHandle<()>>,
}

impl Ledger {
    /// A ledger writing to `path` from a thread of its own.
    pub fn start(path: &Path) -> Result<Self, LedgerError> {
        Self::start_with(path, QUEUE)
    }

    /// [`Ledger::start`] with a queue of `queue` rows.
    pub fn start_with(path: &Path, queue: usize) -> Result<Self, LedgerError> {
        let conn = open(path)?;
        let (tx, rx) = sync_channel(queue.max(1));
        let writer = std::thread::Builder::new()
            .name("tandem-ledger".into())
            .spawn(move || writer(conn, rx))
            .map_err(|e| LedgerError::Open {
                path: path.display().to_string(),
                source: rusqlite::Error::ToSqlConversionFailure(Box::new(e)),
            })?;
        Ok(Self {
            tx: Some(tx),
            held: BTreeMap::new(),
            writer: Some(writer),
        })
    }

    /// Record `row`: queued for the writer, or coalesced with its tenant's held rows when the
    /// queue is full. Never blocks.
    pub fn record(&mut self, row: Row) {
        self.flush_held();
        if !self.held.is_empty() {
            self.hold(row);
            return;
        }
        let Some(tx) = &self.tx else {
            return;
        };
        match tx.try_send(row) {
            Ok(()) => {}
            Err(TrySendError::Full(row)) => self.hold(row),
            Err(TrySendError::Disconnected(row)) => {
                tracing::error!(
                    "the ledger writer is gone; a row of tenant {} is lost",
                    row.tenant
                )
            }
        }
    }

    fn hold(&mut self, row: Row) {
        match self.held.get_mut(&row.tenant) {
            Some(h) => h.absorb(&row),
            None => {
                self.held.insert(row.tenant.clone(), row);
            }
        }
    }

    /// Send held rows while there is room.
    fn flush_held(&mut self) {
        let Some(tx) = &self.tx else {
            return;
        };
        while let Some((t, r)) = self.held.pop_first() {
            match tx.try_send(r) {
                Ok(()) => {}
                Err(TrySendError::Full(r)) | Err(TrySendError::Disconnected(r)) => {
                    self.held.insert(t, r);
                    break;
                }
            }
        }
    }

    /// Rows waiting in the ledger, coalesced (not yet in the writer's queue).
    pub fn held(&self) -> usize {
        self.held.len()
    }
}

impl Drop for Ledger {
    /// Hand over what is held (waiting for room now: this is the end), then let the writer
    /// finish.
    fn drop(&mut self) {
        if let Some(tx) = self.tx.take() {
            for (_, r) in std::mem::take(&mut self.held) {
                let _ = tx.send(r);
            }
        }
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}

/// Attempts at a transaction before its rows are given up (logged with their counts), the first
/// wait and its doubling cap.
const ATTEMPTS: u32 = 8;
const FIRST_WAIT_MS: u64 = 100;
const MAX_WAIT_MS: u64 = 10_000;

/// The writer: whatever has arrived, in one transaction, until every sender is gone. A
/// transaction that fails is tried again, waiting longer each time.
fn writer(mut conn: Connection, rx: Receiver<Row>) {
    while let Ok(first) = rx.recv() {
        let mut rows = vec![first];
        rows.extend(rx.try_iter().take(QUEUE));
        let mut wait = FIRST_WAIT_MS;
        for attempt in 1..=ATTEMPTS {
            match write(&mut conn, &rows) {
                Ok(()) => break,
                Err(e) if attempt == ATTEMPTS => {
                    let committed: u64 = rows.iter().map(|r| r.committed_tokens).sum();
                    tracing::error!(
                        "{e}: {} rows ({} sessions, {committed} committed tokens) not written",
                        rows.len(),
                        rows.iter().map(|r| r.sessions).sum::<u64>()
                    );
                }
                Err(e) => {
                    tracing::warn!("{e}: trying again in {wait} ms");
                    std::thread::sleep(std::time::Duration::from_millis(wait));
                    wait = (wait * 2).min(MAX_WAIT_MS);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(tenant: &str, session: u64, committed: u64) -> Row {
        Row {
            tenant: tenant.into(),
            session: Some(session),
            sessions: 1,
            speculative: true,
            opened_ms: 1_000 + session as i64,
            closed_ms: 2_000 + session as i64,
            prompt_tokens: 10,
            cached_prompt_tokens: 4,
            committed_tokens: committed,
            verified_positions: 7,
            accepted_draft_tokens: committed / 2,
            cloud_tokens: committed - committed / 2,
            decoded_tokens: 1,
            finish_reason: "length".into(),
        }
    }

    fn temp(name: &str) -> std::path::PathBuf {
        let p = std::env::temp_dir().join(format!(
            "tandem-ledger-{name}-{}.sqlite",
            std::process::id()
        ));
        let _ = std::fs::remove_file(&p);
        p
    }

    #[test]
    fn rows_are_written_and_totalled_per_tenant_and_survive_a_reopen() {
        let p = temp("rows");
        {
            let mut l = Ledger::start(&p).unwrap();
            l.record(row("a", 1, 20));
            l.record(row("b", 2, 5));
            l.record(row("a", 3, 10));
        }
        let c = open(&p).unwrap();
        let t = totals(&c, None, 0).unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(
            (t[0].tenant.as_str(), t[0].sessions, t[0].committed_tokens),
            ("a", 2, 30)
        );
        assert_eq!(t[0].accepted_draft_tokens + t[0].cloud_tokens, 30);
        assert_eq!(totals(&c, Some("b"), 0).unwrap()[0].committed_tokens, 5);
        assert!(totals(&c, None, 10_000).unwrap().is_empty(), "since");
        drop(c);
        // Reopened: the rows stay, new ones add to them.
        {
            let mut l = Ledger::start(&p).unwrap();
            l.record(row("b", 4, 6));
        }
        let c = open(&p).unwrap();
        assert_eq!(totals(&c, Some("b"), 0).unwrap()[0].committed_tokens, 11);
        assert_eq!(totals(&c, Some("a"), 0).unwrap()[0].cached_prompt_tokens, 8);
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn a_ledger_of_an_older_verifier_gains_the_cached_column_and_keeps_its_rows() {
        let p = temp("older");
        {
            // The schema before the prefix cache, with one row.
            let c = Connection::open(&p).unwrap();
            c.execute_batch(
                &SCHEMA.replace(",\n    cached_prompt_tokens INTEGER NOT NULL DEFAULT 0", ""),
            )
            .unwrap();
            c.execute_batch(
                "INSERT INTO sessions (tenant, session, sessions, speculative, opened_ms,
                 closed_ms, prompt_tokens, committed_tokens, verified_positions,
                 accepted_draft_tokens, cloud_tokens, decoded_tokens, finish_reason)
                 VALUES ('a', 1, 1, 1, 0, 1, 10, 5, 5, 3, 2, 0, 'stop')",
            )
            .unwrap();
            let cols: i64 = c
                .query_row(
                    "SELECT COUNT(*) FROM pragma_table_info('sessions')",
                    [],
                    |r| r.get(0),
                )
                .unwrap();
            assert_eq!(cols, 14, "the old schema has no cached column");
        }
        {
            let mut l = Ledger::start(&p).unwrap();
            l.record(row("a", 2, 20));
        }
        let c = open(&p).unwrap();
        let t = &totals(&c, Some("a"), 0).unwrap()[0];
        assert_eq!(
            (t.sessions, t.prompt_tokens, t.cached_prompt_tokens),
            (2, 20, 4)
        );
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn a_full_queue_coalesces_rows_per_tenant_and_loses_no_count() {
        let p = temp("full");
        // A queue of one row and a writer held up by a write lock on the file: the rows after
        // the first two pile up in the ledger, coalesced per tenant.
        let mut l = Ledger::start_with(&p, 1).unwrap();
        let blocker = open(&p).unwrap();
        blocker.execute_batch("BEGIN EXCLUSIVE").unwrap();
        for i in 0..50 {
            l.record(row(if i % 2 == 0 { "a" } else { "b" }, i, 2));
        }
        assert!(l.held() >= 1 && l.held() <= 2, "{}", l.held());
        blocker.execute_batch("COMMIT").unwrap();
        drop(blocker);
        drop(l);
        let c = open(&p).unwrap();
        let t = totals(&c, None, 0).unwrap();
        let sum = |f: fn(&Totals) -> u64| t.iter().map(f).sum::<u64>();
        assert_eq!(sum(|t| t.sessions), 50);
        assert_eq!(sum(|t| t.committed_tokens), 100);
        assert_eq!(sum(|t| t.prompt_tokens), 500);
        assert_eq!(sum(|t| t.cached_prompt_tokens), 200);
        let rows: i64 = c
            .query_row("SELECT COUNT(*) FROM sessions", [], |r| r.get(0))
            .unwrap();
        assert!(rows < 50, "coalesced: {rows} rows");
        let _ = std::fs::remove_file(&p);
    }
}
