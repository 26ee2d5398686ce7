//! Where a run's tokens come from.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Where tokens come from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// Token file (`.bin` with its `.bin.json` sidecar) or Megatron indexed dataset (its
    /// prefix: `PREFIX.bin` + `PREFIX.idx`); empty (and no blend) = the embedded synthetic
    /// corpus.
    pub path: Option<PathBuf>,
    /// Several corpora mixed by weight, `[[weight, path], …]` (each path as `path` takes
    /// it); instead of `path`. The weights are normalised to sum to 1.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub blend: Vec<(f64, PathBuf)>,
    /// Token file evaluated at the end of the run (mean next-token loss); optional.
    pub eval_path: Option<PathBuf>,
    /// Document masking: a window packed from several documents attends only within each
    /// document, and RoPE positions restart at each one. Documents end at `eos_id`.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub document_mask: bool,
    /// The end-of-document token (the token after it starts a new document); read by
    /// `document_mask`, which needs it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eos_id: Option<u32>,
}

impl DataConfig {
    /// Whether the run reads files (`path` or `blend`) rather than the synthetic corpus.
    pub fn reads_files(&self) -> bool {
        self.path.is_some() || !self.blend.is_empty()
    }

    /// The end-of-document token when documents are masked (None: plain causal windows).
    pub fn document_eos(&self) -> Option<u32> {
        self.eos_id.filter(|_| self.document_mask)
    }

    /// Every training corpus the run reads: `path`, or each of `blend`'s.
    pub fn training_paths(&self) -> Vec<&Path> {
        match &self.path {
            Some(p) => vec![p.as_path()],
            None => self.blend.iter().map(|(_, p)| p.as_path()).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::Config;

    #[test]
    fn a_blend_reads_from_toml_and_overrides_and_survives_a_round_trip() {
        let c = Config::from_toml_with_overrides(
            "[data]\nblend = [[3, \"a/corpus_text_document\"], [1.5, \"b.bin\"]]\n",
            &[],
        )
        .unwrap();
        assert_eq!(
            c.data.blend,
            vec![
                (3.0, "a/corpus_text_document".into()),
                (1.5, "b.bin".into())
            ]
        );
        assert_eq!(c.data.training_paths().len(), 2);
        let again = c.with_overrides(&[]).unwrap();
        assert_eq!(again.data, c.data);
        let set = Config::from_toml_with_overrides(
            "",
            &["data.blend=[[1, \"x.bin\"], [2, \"y\"]]".to_owned()],
        )
        .unwrap();
        assert_eq!(set.data.blend[1], (2.0, "y".into()));
        assert!(set.data.reads_files() && !Config::default().data.reads_files());
    }

    #[test]
    fn a_blend_beside_a_path_or_with_a_bad_weight_is_refused() {
        for (toml, needle) in [
            (
                "[data]\npath = \"a.bin\"\nblend = [[1, \"b.bin\"]]",
                "not both",
            ),
            ("[data]\nblend = [[0, \"b.bin\"]]", "weight 0"),
            ("[data]\nblend = [[-1, \"b.bin\"]]", "weight -1"),
        ] {
            let err = Config::from_toml_with_overrides(toml, &[])
                .unwrap_err()
                .to_string();
            assert!(err.contains("data.blend") && err.contains(needle), "{err}");
        }
    }

    #[test]
    fn document_masking_needs_an_end_of_document_token_in_the_vocabulary() {
        let ok =
            Config::from_toml_with_overrides("[data]\ndocument_mask = true\neos_id = 7\n", &[])
                .unwrap();
        assert_eq!(ok.data.document_eos(), Some(7));
        assert_eq!(Config::default().data.document_eos(), None);
        for (sets, needle) in [
            (
                &["data.document_mask=true"][..],
                "needs the end-of-document token",
            ),
            (&["data.eos_id=3"][..], "only by document masking"),
            (
                &["data.document_mask=true", "data.eos_id=100000"][..],
                "outside the model's vocabulary",
            ),
        ] {
            let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            let err = Config::from_toml_with_overrides("", &sets)
                .unwrap_err()
                .to_string();
            assert!(err.contains("data.eos_id") && err.contains(needle), "{err}");
        }
        // Attention as products has no document mask: refused rather than ignored.
        let sets: Vec<String> = [
            "data.document_mask=true",
            "data.eos_id=7",
            "train.device=\"cuda\"",
            "train.attention=\"products\"",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let err = Config::from_toml_with_overrides("", &sets)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("train.attention") && err.contains("document_mask"),
            "{err}"
        );
    }
}
