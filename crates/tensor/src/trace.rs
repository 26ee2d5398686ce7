//! Per-rank timelines: spans on named tracks, written as Chrome trace JSON (one process per
//! rank, one thread per track) that Perfetto and chrome://tracing open.
//!
//! Tracks never hold overlapping spans: `Compute` and `Wait` are both recorded by the rank's
//! own thread (a wait inside a layer goes on `Wait`, the layer on `Compute`), `Comm` by its
//! communication worker, which runs one operation at a time, and `Step` holds whole steps.

use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::Instant;

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

/// Collects one rank's spans.
#[derive(Debug)]
pub struct Tracer {
    origin: Instant,
    spans: Mutex<Vec<Span>>,
}

impl Tracer {
    /// A tracer whose times count from `origin` (share one origin across ranks to align them).
    pub fn new(origin: Instant) -> Self {
        Tracer {
            origin,
            spans: Mutex::new(Vec::new()),
        }
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
    out.push_str("\n]}\n");
    out
}
