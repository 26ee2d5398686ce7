//! `ferrotron report`: one self-contained HTML page comparing runs and sweeps.

use std::path::PathBuf;

/// Arguments of `report`.
#[derive(clap::Args)]
pub struct ReportArgs {
    /// Run directories (`run.dir` of `train`) and sweep directories (`--out` of `sweep`).
    #[arg(required = true)]
    dirs: Vec<PathBuf>,
    /// The page to write.
    #[arg(long, short)]
    output: PathBuf,
    /// Replace the page if it exists.
    #[arg(long)]
    overwrite: bool,
}

pub fn run(a: ReportArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.overwrite || !a.output.exists(),
        "-o {}: the file exists; pass --overwrite to replace it, or choose another name",
        a.output.display()
    );
    let data = ferrotron_report::collect(&a.dirs)?;
    let html = ferrotron_report::report_html(&data);
    ferrotron_report::write_atomic(&a.output, html.as_bytes())?;
    println!(
        "{}: {} run(s), {} sweep(s), {} KiB",
        a.output.display(),
        data.runs.len(),
        data.sweeps.len(),
        html.len().div_ceil(1024)
    );
    Ok(())
}
