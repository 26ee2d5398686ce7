//! Per-rank timelines: spans on named tracks, written as Chrome trace JSON (one process per
//! rank, one thread per track) that Perfetto and chrome://tracing open.
//!
//! Tracks never hold overlapping spans: `Compute` and `Wait` are both recorded by the rank's
//! own thread (a wait inside a layer goes on `Wait`, the layer on `Compute`), `Comm` by its
//! communication worker, which runs one operation at a time, and `Step` holds whole steps.

use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::Instant;

use crate::{Category, Ledger};

/// A stream of work of one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Track {
    /// Whole optimizer steps.
    Step,
    /// Forward/backward of layers, the loss, the optimizer update, data loading.
    Compute,
    /// Collectives and messages as the communication worker executes them.
    Comm,
    /// Time the rank's thread is blocked on communication (exposed communication, bubbles).
    Wait,
}

impl Track {
    /// Every track, in display order.
    pub const ALL: [Track; 4] = [Track::Step, Track::Compute, Track::Comm, Track::Wait];
    /// Display name.
    pub fn name(self) -> &'static str {
        match self {
            Track::Step => "step",
            Track::Compute => "compute",
            Track::Comm => "communication",
            Track::Wait => "waits",
        }
    }
    fn tid(self) -> usize {
        self as usize
    }
}

/// One recorded span.
#[derive(Debug, Clone)]
pub struct Span {
    /// Track.
    pub track: Track,
    /// What ran (e.g. `forward block 3`, `all_reduce`).
    pub name: String,
    /// Category (`forward`, `backward`, `collective`, `bubble`, …).
    pub cat: &'static str,
    /// Start, microseconds since the tracer's origin.
    pub start_us: f64,
    /// Duration in microseconds.
    pub dur_us: f64,
    /// Extra key/value details (micro-batch, group, bytes, …).
    pub args: Vec<(&'static str, String)>,
}

/// The ledger's current bytes per category at one instant.
#[derive(Debug, Clone, Copy)]
pub struct MemorySample {
    /// Microseconds since the tracer's origin.
    pub at_us: f64,
    /// Bytes per category, indexed like [`Category::ALL`].
    pub bytes: [usize; Category::COUNT],
}

/// Collects one rank's spans and memory samples.
#[derive(Debug)]
pub struct Tracer {
    origin: Instant,
    spans: Mutex<Vec<Span>>,
    memory: Mutex<Vec<MemorySample>>,
}

impl Tracer {
    /// A tracer whose times count from `origin` (share one origin across ranks to align them).
    pub fn new(origin: Instant) -> Self {
        Tracer {
            origin,
            spans: Mutex::new(Vec::new()),
            memory: Mutex::new(Vec::new()),
        }
    }

    /// Samples the ledger's current bytes per category now.
    pub fn sample_memory(&self, ledger: &Ledger) {
        let snap = ledger.snapshot();
        let at_us = Instant::now()
            .saturating_duration_since(self.origin)
            .as_secs_f64()
            * 1e6;
        self.memory.lock().expect("trace lock").push(MemorySample {
            at_us,
            bytes: snap.current,
        });
    }

    /// Every memory sample so far, removed from the tracer.
    pub fn take_memory(&self) -> Vec<MemorySample> {
        std::mem::take(&mut *self.memory.lock().expect("trace lock"))
    }

    /// Records a span from `start` to `end`.
    pub fn record(
        &self,
        track: Track,
        name: impl Into<String>,
        cat: &'static str,
        start: Instant,
        end: Instant,
        args: Vec<(&'static str, String)>,
    ) {
        let start_us = start.saturating_duration_since(self.origin).as_secs_f64() * 1e6;
        let dur_us = end.saturating_duration_since(start).as_secs_f64() * 1e6;
        let span = Span {
            track,
            name: name.into(),
            cat,
            start_us,
            dur_us,
            args,
        };
        self.spans.lock().expect("trace lock").push(span);
    }

    /// Every span recorded so far, removed from the tracer.
    pub fn take(&self) -> Vec<Span> {
        std::mem::take(&mut *self.spans.lock().expect("trace lock"))
    }

    /// A copy of every span recorded so far.
    pub fn spans(&self) -> Vec<Span> {
        self.spans.lock().expect("trace lock").clone()
    }
}

/// Runs `f`, recording it on `track` when a tracer is given.
pub fn traced<R>(
    tracer: Option<&Tracer>,
    track: Track,
    cat: &'static str,
    name: impl FnOnce() -> String,
    args: Vec<(&'static str, String)>,
    f: impl FnOnce() -> R,
) -> R {
    match tracer {
        None => f(),
        Some(t) => {
            let start = Instant::now();
            let out = f();
            t.record(track, name(), cat, start, Instant::now(), args);
            out
        }
    }
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

/// Chrome trace JSON of several ranks: `(rank, spans)`; one process per rank named
/// `rank N`, one thread per track.
pub fn chrome_trace_json(ranks: &[(usize, Vec<Span>)]) -> String {
    chrome_trace_json_with_memory(ranks, &[])
}

/// Like [`chrome_trace_json`], plus each rank's memory samples as a counter track (MiB per
/// ledger category).
pub fn chrome_trace_json_with_memory(
    ranks: &[(usize, Vec<Span>)],
    memory: &[(usize, Vec<MemorySample>)],
) -> String {
    let mut out = String::from("{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n");
    let mut first = true;
    let mut push = |out: &mut String, event: String| {
        if !first {
            out.push_str(",\n");
        }
        first = false;
        out.push_str(&event);
    };
    for (rank, spans) in ranks {
        push(&mut out, format!("{{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":{rank},\"tid\":0,\"args\":{{\"name\":\"rank {rank}\"}}}}"));
        for track in Track::ALL {
            push(
                &mut out,
                format!(
                    "{{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":{rank},\"tid\":{},\"args\":{{\"name\":\"{}\"}}}}",
                    track.tid(),
                    track.name()
                ),
            );
        }
        for s in spans {
            let mut args = String::new();
            for (i, (k, v)) in s.args.iter().enumerate() {
                let _ = write!(
                    args,
                    "{}\"{}\":\"{}\"",
                    if i > 0 { "," } else { "" },
                    k,
                    escape(v)
                );
            }
            push(
                &mut out,
                format!(
                    "{{\"ph\":\"X\",\"pid\":{rank},\"tid\":{},\"name\":\"{}\",\"cat\":\"{}\",\"ts\":{:.3},\"dur\":{:.3},\"args\":{{{args}}}}}",
                    s.track.tid(),
                    escape(&s.name),
                    s.cat,
                    s.start_us,
                    s.dur_us
                ),
            );
        }
    }
    for (rank, samples) in memory {
        for m in samples {
            let values: Vec<String> = Category::ALL
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    format!(
                        "\"{}\":{:.3}",
                        c.name(),
                        m.bytes[i] as f64 / (1u64 << 20) as f64
                    )
                })
                .collect();
            push(
                &mut out,
                format!("{{\"ph\":\"C\",\"pid\":{rank},\"name\":\"memory (MiB)\",\"ts\":{:.3},\"args\":{{{}}}}}", m.at_us, values.join(",")),
            );
        }
    }
    out.push_str("\n]}\n");
    out
}
