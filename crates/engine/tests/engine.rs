//! The engine as a library: a run started in the background streams the leader's steps as
//! the trainer computes them, ends with the summary it writes, stops on request after an
//! agreed step with a checkpoint of it, and refuses bad options before any work.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use ferrotron_engine::{start, train, Console, EngineError, Outcome, TrainOptions};

/// A console that keeps every line.
#[derive(Default)]
struct Lines(Mutex<Vec<String>>);

impl Console for Lines {
    fn say(&self, line: &str) {
        self.0.lock().unwrap().push(line.to_string());
    }
}

fn run_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrotron-engine-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn options(dir: &Path, sets: &[&str]) -> TrainOptions {
    let mut set: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    set.push(format!("run.dir={:?}", dir.display().to_string()));
    TrainOptions {
        set,
        ..TrainOptions::default()
    }
}

/// The losses `metrics.jsonl` recorded, in step order.
fn recorded_losses(dir: &Path) -> Vec<f64> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"]
                .as_f64()
                .unwrap()
        })
        .collect()
}

#[test]
fn a_started_run_streams_its_steps_and_ends_with_its_summary() {
    let dir = run_dir("stream");
    let sets = ["train.steps=6", "parallel.dp=2"];
    let lines = Arc::new(Lines::default());
    let mut run = start(&options(&dir, &sets), lines.clone()).unwrap();
    let streamed: Vec<_> = run.by_ref().collect();
    let Outcome::Finished(Some(summary)) = run.wait().unwrap() else {
        panic!("the run did not finish with a summary");
    };
    assert_eq!(
        streamed.iter().map(|s| s.step).collect::<Vec<_>>(),
        (1..=6).collect::<Vec<_>>()
    );
    // The streamed losses are the ones written to metrics.jsonl, bit for bit, and the
    // summary's final loss is the last of them.
    let losses: Vec<f64> = streamed.iter().map(|s| s.loss).collect();
    assert_eq!(losses, recorded_losses(&dir));
    assert_eq!(summary.final_loss, losses[5]);
    assert_eq!(summary.steps, 6);
    let written: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap();
    assert_eq!(written["final_loss"].as_f64(), Some(losses[5]));
    // The same configuration through the lighter library run (no disk) trains the same
    // losses: one engine under both calls.
    let mut config = ferrotron_config::Config::default();
    config.train.steps = 6;
    config.parallel.dp = 2;
    let mut light = ferrotron_train::Run::new(config).start().unwrap();
    let light_losses: Vec<f64> = light.by_ref().map(|s| s.loss).collect();
    light.wait().unwrap();
    assert_eq!(losses, light_losses);
    let said = lines.0.lock().unwrap().join("\n");
    assert!(said.contains("done: final loss"), "{said}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_stopped_run_saves_the_agreed_step_and_says_interrupted() {
    let dir = run_dir("stop");
    let sets = ["train.steps=50", "parallel.dp=2"];
    let mut run = start(&options(&dir, &sets), Arc::new(Lines::default())).unwrap();
    let first = run.next().expect("a first step");
    run.stop();
    let rest: Vec<_> = run.by_ref().collect();
    let Outcome::Interrupted {
        stop,
        summary: kept,
    } = run.wait().unwrap()
    else {
        panic!("the run was not interrupted");
    };
    let last = rest.last().map_or(first.step, |s| s.step);
    assert!(last < 50, "stopped at step {last}");
    assert!(
        stop.to_string().contains(&format!("after step {last}")),
        "{stop}"
    );
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["status"], "interrupted");
    let kept = kept.expect("the leader's summary");
    assert_eq!((kept.status, kept.steps), ("interrupted", last));
    assert_eq!(summary["steps"].as_u64(), Some(last as u64));
    let saved = ferrotron_train::checkpoint::list_checkpoints(&dir.join("checkpoints"));
    assert_eq!(
        saved.iter().map(|(step, _)| *step).collect::<Vec<_>>(),
        [last]
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_options_are_refused_before_any_work() {
    let dir = run_dir("refused");
    let mut traced = options(&dir, &["train.steps=3"]);
    traced.trace = true;
    traced.trace_steps = Some("5-9".into());
    let Err(EngineError::Refused(why)) = start(&traced, Arc::new(Lines::default())) else {
        panic!("trace steps outside the run were accepted");
    };
    assert!(why.contains("--trace-steps 5-9"), "{why}");
    let unknown = options(&dir, &["train.stpes=3"]);
    let err = train(&unknown, Arc::new(Lines::default()))
        .unwrap_err()
        .to_string();
    assert!(err.contains("stpes"), "{err}");
    assert!(!dir.exists(), "a refused run wrote {}", dir.display());
}

/// The handler of signal `n` now.
fn handler(n: libc::c_int) -> libc::sighandler_t {
    // SAFETY: reads the current action into a zeroed struct; installs nothing.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        assert_eq!(libc::sigaction(n, std::ptr::null(), &mut action), 0);
        action.sa_sigaction
    }
}

#[test]
fn a_run_that_catches_signals_ends_its_stream_and_gives_the_handlers_back() {
    let dir = run_dir("signals");
    let mut caught = options(&dir, &["train.steps=3"]);
    caught.signals = true;
    let before = handler(libc::SIGUSR1);
    let mut run = start(&caught, Arc::new(Lines::default())).unwrap();
    // The stream ends with the run, though the signal watcher outlives no step of it.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let steps: Vec<usize> = run.by_ref().map(|s| s.step).collect();
        let _ = tx.send((
            steps,
            run.wait().map(|o| matches!(o, Outcome::Finished(Some(_)))),
        ));
    });
    let (steps, finished) = rx
        .recv_timeout(std::time::Duration::from_secs(300))
        .expect("the run's stream did not end");
    assert_eq!(steps, [1, 2, 3]);
    assert!(finished.unwrap());
    assert_eq!(
        handler(libc::SIGUSR1),
        before,
        "the handler was not given back"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
