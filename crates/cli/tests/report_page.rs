//! `ferrotron report`: the page of two runs and a sweep, written self-contained, and (with
//! `--features browser`, which CI runs with Debian's Chromium installed) loaded in headless
//! Chromium: no script error, no console message, every chart drawn, one line per run in
//! each of the four step charts.

mod common;

use std::path::Path;

use common::{bin, fails_with, ok, scratch};

const SMALL: [&str; 5] = [
    "model.layers=2",
    "model.seq_len=32",
    "train.micro_batch=2",
    "train.steps=6",
    "train.threads=1",
];

/// Two runs (another learning rate) and a sweep of dp1, dp2 and an invalid tp3 in `root`;
/// the page of all three.
fn page(root: &Path) -> String {
    for (dir, lr) in [("a", "0.001"), ("b", "0.003")] {
        let mut cmd = bin();
        cmd.current_dir(root).args(["train", "--quiet"]);
        for set in SMALL {
            cmd.args(["--set", set]);
        }
        ok(cmd.args([
            "--set",
            &format!("run.dir={dir}"),
            "--set",
            &format!("train.lr={lr}"),
        ]));
    }
    let mut sweep = bin();
    sweep
        .current_dir(root)
        .args(["sweep", "--out", "sw", "--grid", "parallel.dp=1,2"]);
    sweep.args(["--grid", "parallel.tp=1,3"]);
    for set in SMALL {
        sweep.args(["--set", set]);
    }
    ok(&mut sweep);
    let out = ok(bin()
        .current_dir(root)
        .args(["report", "a", "b", "sw", "-o", "report.html"]));
    assert!(out.contains("4 run(s), 1 sweep(s)"), "{out}");
    std::fs::read_to_string(root.join("report.html")).unwrap()
}

#[test]
fn the_page_carries_everything_and_fetches_nothing() {
    let root = scratch("report-page");
    let html = page(&root);
    for needle in [
        "src=",
        "href=",
        "url(",
        "fetch(",
        "XMLHttpRequest",
        "@import",
        "<link",
    ] {
        assert!(
            !html.contains(needle),
            "the page would fetch something: {needle}"
        );
    }
    // The only address is SVG's namespace name, which is never fetched.
    let addresses: Vec<&str> = html
        .match_indices("http")
        .map(|(i, _)| &html[i..i + 26])
        .collect();
    assert!(
        addresses
            .iter()
            .all(|a| a.starts_with("http://www.w3.org/2000/svg")),
        "{addresses:?}"
    );
    // Every run's steps and configuration, and the sweep's every row, are in it.
    for needle in [
        "\"name\":\"a\"",
        "\"name\":\"sw/dp2-tp1\"",
        "\"lr\":0.003",
        "invalid_layout",
    ] {
        assert!(html.contains(needle), "{needle}");
    }
    // An existing page is kept unless asked; a directory that is no run is named.
    fails_with(
        bin()
            .current_dir(&root)
            .args(["report", "a", "-o", "report.html"]),
        "--overwrite",
    );
    ok(bin()
        .current_dir(&root)
        .args(["report", "a", "-o", "report.html", "--overwrite"]));
    std::fs::create_dir_all(root.join("empty")).unwrap();
    fails_with(
        bin()
            .current_dir(&root)
            .args(["report", "empty", "-o", "x.html"]),
        "empty: neither a run directory",
    );
    assert!(!root.join("x.html").exists());
}

/// The page in headless Chromium (Debian's package; the flags keep it off the network).
#[cfg(feature = "browser")]
#[test]
fn headless_chromium_draws_every_chart_without_an_error() {
    let root = scratch("report-browser");
    page(&root);
    let out = std::process::Command::new("chromium")
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--enable-logging=stderr",
            "--v=0",
        ])
        .arg(format!(
            "--user-data-dir={}",
            root.join("profile").display()
        ))
        .arg("--dump-dom")
        .arg(format!("file://{}", root.join("report.html").display()))
        .output()
        .expect("chromium (apt install chromium)");
    assert!(out.status.success());
    let dom = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let body = dom
        .split("<body")
        .nth(1)
        .and_then(|b| b.split('>').next())
        .unwrap();
    assert_eq!(
        body.trim(),
        r#"data-charts-expected="6" data-charts-drawn="6" data-errors="0" data-ready="1""#
    );
    assert!(!stderr.contains("CONSOLE"), "console output: {stderr}");
    // Loss (smoothed), lr, tokens/s and MFU: one line per run each; the raw loss behind.
    assert_eq!(dom.matches(r#"class="series""#).count(), 4 * 4);
    assert_eq!(dom.matches(r#"class="raw""#).count(), 4);
    // The runs differ in train.lr (and run.dir, and the sweep's in parallel.dp): shown.
    assert!(
        dom.contains(r#"<tr class="differs"><td>train.lr</td>"#),
        "config diff"
    );
    assert_eq!(
        dom.matches(r#"<tr class="failed">"#).count(),
        2,
        "the sweep's tp3 rows"
    );
}
