//! Slurm batch scripts for a sweep: one `job.sbatch` per layout from a template, and the
//! shell quoting their command lines need.

/// The batch script of one layout when no template is given: ⌈world / GPUs per node⌉
/// nodes, one task per rank, `srun` of the training command.
pub const DEFAULT_SLURM_TEMPLATE: &str = "#!/bin/bash
#SBATCH --job-name={job_name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks={ntasks}
#SBATCH --ntasks-per-node={ntasks_per_node}
#SBATCH --gpus-per-node={gpus_per_node}
#SBATCH --output={dir}/slurm-%j.out
set -euo pipefail
srun {command}
";

/// `text` quoted for a POSIX shell when it needs quoting.
pub fn shell_quote(text: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "_./=,:+-@%".contains(c);
    if !text.is_empty() && text.chars().all(plain) {
        text.to_string()
    } else {
        format!("'{}'", text.replace('\'', "'\\''"))
    }
}

/// One layout's batch job.
#[derive(Debug, Clone)]
pub struct SlurmJob<'a> {
    /// Layout name (`{layout}`; the job is named `ferrotron-<layout>`).
    pub layout: &'a str,
    /// Ranks of the layout: tasks of the job.
    pub world: usize,
    /// GPUs (ranks) per node, at least 1.
    pub gpus_per_node: usize,
    /// The layout's run directory (`{dir}`).
    pub dir: &'a str,
    /// The training command, program first (`{command}`, shell-quoted).
    pub argv: &'a [String],
}

/// Why a template cannot be used, if it cannot.
pub fn check_template(template: &str) -> Result<(), String> {
    if template.contains("{command}") {
        Ok(())
    } else {
        Err("no {command} placeholder; add a line such as `srun {command}`".into())
    }
}

/// Fills `template`'s placeholders for `job`: {command}, {job_name}, {layout}, {nodes},
/// {ntasks}, {world}, {ntasks_per_node}, {gpus_per_node} and {dir}. Other braces (such as
/// `${SLURM_JOB_ID}`) are left alone.
pub fn slurm_script(template: &str, job: &SlurmJob) -> String {
    let per_node = job.gpus_per_node.max(1);
    let used = job.world.min(per_node);
    let command: Vec<String> = job.argv.iter().map(|a| shell_quote(a)).collect();
    let fields = [
        ("command", command.join(" ")),
        ("job_name", format!("ferrotron-{}", job.layout)),
        ("layout", job.layout.to_string()),
        ("nodes", job.world.div_ceil(per_node).max(1).to_string()),
        ("ntasks", job.world.to_string()),
        ("world", job.world.to_string()),
        ("ntasks_per_node", used.to_string()),
        ("gpus_per_node", used.to_string()),
        ("dir", job.dir.to_string()),
    ];
    fields.iter().fold(template.to_string(), |s, (k, v)| {
        s.replace(&format!("{{{k}}}"), v)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_script_sizes_nodes_from_world() {
        let argv = [
            "/bin/ferrotron".to_string(),
            "train".into(),
            "--set".into(),
            "run.dir=\"/a b\"".into(),
        ];
        let job = SlurmJob {
            layout: "dp4-tp4",
            world: 16,
            gpus_per_node: 8,
            dir: "/out/dp4-tp4",
            argv: &argv,
        };
        let script = slurm_script(DEFAULT_SLURM_TEMPLATE, &job);
        assert!(script.starts_with("#!/bin/bash\n#SBATCH --job-name=ferrotron-dp4-tp4\n#SBATCH --nodes=2\n#SBATCH --ntasks=16\n#SBATCH --ntasks-per-node=8\n"), "{script}");
        assert!(
            script.contains("srun /bin/ferrotron train --set 'run.dir=\"/a b\"'\n"),
            "{script}"
        );
        let small = SlurmJob { world: 2, ..job };
        let script = slurm_script(
            "{nodes} {ntasks_per_node} ${SLURM_JOB_ID} {command}",
            &small,
        );
        assert!(
            script.starts_with("1 2 ${SLURM_JOB_ID} /bin/ferrotron"),
            "{script}"
        );
    }

    #[test]
    fn templates_need_a_command_and_quotes_survive() {
        assert!(check_template("srun {command}").is_ok());
        assert!(check_template("srun x").unwrap_err().contains("{command}"));
        assert_eq!(shell_quote("it's"), "'it'\\''s'");
        assert_eq!(shell_quote("parallel.dp=2"), "parallel.dp=2");
        assert_eq!(shell_quote(""), "''");
    }
}
