//! Hardware profiles: device memory, dense peak, node size and measured bus bandwidth per
//! collective, as TOML data files embedded in the crate (`crates/plan/hardware/*.toml`).

use ferrotron_config::DType;
use serde::{Deserialize, Serialize};

use crate::PlanError;

/// Point-to-point bandwidth between two devices, GB/s in one direction.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct P2pBandwidth {
    /// Both devices in one node.
    pub intra: f64,
    /// Devices in different nodes.
    pub inter: f64,
}

/// Bus bandwidth (nccl-tests definition, GB/s) of each collective, by number of nodes the
/// group spans. The time of a collective moving `V` bytes per rank (`2(N−1)/N·K` for an
/// all-reduce of `K` bytes, `(N−1)/N·K` for an all-gather, reduce-scatter or all-to-all) is
/// `V / busbw`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BusBandwidth {
    /// Node counts of the measurements, increasing; 1 = within one node.
    pub nodes: Vec<usize>,
    /// All-reduce.
    pub all_reduce: Vec<f64>,
    /// All-gather.
    pub all_gather: Vec<f64>,
    /// Reduce-scatter.
    pub reduce_scatter: Vec<f64>,
    /// All-to-all.
    pub all_to_all: Vec<f64>,
}

/// Fixed time of one collective or transfer, whatever its size (launch, synchronisation,
/// the ring's first hop): what makes many small messages slower than one large one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Latency {
    /// Within a node, microseconds.
    pub intra_us: f64,
    /// Across nodes, microseconds.
    pub inter_us: f64,
}

/// A collective operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Collective {
    /// All-reduce.
    AllReduce,
    /// All-gather.
    AllGather,
    /// Reduce-scatter.
    ReduceScatter,
    /// All-to-all.
    AllToAll,
}

/// A cluster node type.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hardware {
    /// Profile name.
    pub name: String,
    /// One line describing the node and where the numbers come from.
    pub description: String,
    /// Memory of one device, GiB.
    pub memory_gib: f64,
    /// Dense peak of one device in the training dtype, TFLOP/s (the MFU denominator).
    pub peak_tflops: f64,
    /// Training dtype the planner assumes on this hardware.
    pub dtype: DType,
    /// Devices per node.
    pub gpus_per_node: usize,
    /// Point-to-point bandwidth.
    pub p2p: P2pBandwidth,
    /// Collective bus bandwidth.
    pub bus_bandwidth: BusBandwidth,
    /// Per-operation latency (absent: none).
    #[serde(default)]
    pub latency: Latency,
    /// Measured kernel times of this engine on a host CPU: when present, the cost model
    /// times each unit's kernels with them instead of FLOPs at peak × efficiency
    /// ([`crate::cpu_kernels`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernels: Option<crate::cpu_kernels::KernelRates>,
}

/// The embedded profiles.
const BUILTIN: [(&str, &str); 4] = [
    ("h100", include_str!("../hardware/h100.toml")),
    ("h200", include_str!("../hardware/h200.toml")),
    ("a100", include_str!("../hardware/a100.toml")),
    ("cpu-local", include_str!("../hardware/cpu-local.toml")),
];

impl Hardware {
    /// Names of the embedded profiles.
    pub fn builtin_names() -> Vec<&'static str> {
        BUILTIN.iter().map(|b| b.0).collect()
    }

    /// The embedded profile `name` (`h100`, `h200`, `a100`, `cpu-local`; case-insensitive).
    pub fn builtin(name: &str) -> Result<Self, PlanError> {
        let key = name.to_ascii_lowercase();
        let (_, text) =
            BUILTIN
                .iter()
                .find(|b| b.0 == key)
                .ok_or_else(|| PlanError::UnknownHardware {
                    name: name.to_string(),
                    known: Self::builtin_names().join(", "),
                })?;
        Self::from_toml(text)
    }

    /// Parses and validates a profile.
    pub fn from_toml(text: &str) -> Result<Self, PlanError> {
        let hw: Hardware = toml::from_str(text).map_err(|e| PlanError::Hardware {
            name: "<toml>".into(),
            message: e.to_string(),
        })?;
        hw.validate()?;
        Ok(hw)
    }

    /// Checks that every number is positive and the bandwidth table is consistent.
    pub fn validate(&self) -> Result<(), PlanError> {
        let bad = |message: String| PlanError::Hardware {
            name: self.name.clone(),
            message,
        };
        let positive = |x: f64| x.is_finite() && x > 0.0;
        if let Some(k) = &self.kernels {
            if !(positive(k.bandwidth) && k.call_s.is_finite() && k.call_s >= 0.0) {
                return Err(bad(
                    "kernels: bandwidth must be positive and call_s 0 or more (measure them with `ferrotron validate-cost`)".into(),
                ));
            }
        }
        if !positive(self.memory_gib) || !positive(self.peak_tflops) || self.gpus_per_node == 0 {
            return Err(bad(
                "memory_gib, peak_tflops and gpus_per_node must be positive".into(),
            ));
        }
        if !positive(self.p2p.intra) || !positive(self.p2p.inter) {
            return Err(bad("p2p bandwidths must be positive".into()));
        }
        let b = &self.bus_bandwidth;
        if b.nodes.is_empty() || b.nodes[0] == 0 || b.nodes.windows(2).any(|w| w[0] >= w[1]) {
            return Err(bad(
                "bus_bandwidth.nodes must be increasing node counts ≥ 1".into(),
            ));
        }
        for (op, v) in [
            ("all_reduce", &b.all_reduce),
            ("all_gather", &b.all_gather),
            ("reduce_scatter", &b.reduce_scatter),
            ("all_to_all", &b.all_to_all),
        ] {
            if v.len() != b.nodes.len() || !v.iter().all(|x| positive(*x)) {
                return Err(bad(format!(
                    "bus_bandwidth.{op} needs one positive value per entry of nodes ({})",
                    b.nodes.len()
                )));
            }
        }
        Ok(())
    }

    /// Device memory in bytes.
    pub fn memory_bytes(&self) -> u64 {
        (self.memory_gib * crate::GIB) as u64
    }

    /// Dense peak in FLOP/s.
    pub fn peak_flops(&self) -> f64 {
        self.peak_tflops * 1e12
    }

    /// Bus bandwidth of `op` over a group spanning `nodes` nodes, bytes/s: the table,
    /// interpolated linearly in log(nodes)–log(bandwidth) between measurements and held at
    /// the last measurement beyond the table (no extrapolation).
    pub fn bus_bytes_per_s(&self, op: Collective, nodes: usize) -> f64 {
        let b = &self.bus_bandwidth;
        let v = match op {
            Collective::AllReduce => &b.all_reduce,
            Collective::AllGather => &b.all_gather,
            Collective::ReduceScatter => &b.reduce_scatter,
            Collective::AllToAll => &b.all_to_all,
        };
        let n = nodes.max(1) as f64;
        let gbps = match b.nodes.iter().position(|&x| x as f64 >= n) {
            Some(0) => v[0],
            Some(i) if b.nodes[i] as f64 == n => v[i],
            None => v[v.len() - 1],
            Some(i) => {
                let (x0, x1) = ((b.nodes[i - 1] as f64).ln(), (b.nodes[i] as f64).ln());
                let f = (n.ln() - x0) / (x1 - x0);
                (v[i - 1].ln() * (1.0 - f) + v[i].ln() * f).exp()
            }
        };
        gbps * 1e9
    }

    /// Fixed seconds of one operation, within a node or across nodes.
    pub fn latency_s(&self, across_nodes: bool) -> f64 {
        1e-6 * if across_nodes {
            self.latency.inter_us
        } else {
            self.latency.intra_us
        }
    }

    /// Point-to-point bandwidth in bytes/s, within a node or across nodes.
    pub fn p2p_bytes_per_s(&self, across_nodes: bool) -> f64 {
        1e9 * if across_nodes {
            self.p2p.inter
        } else {
            self.p2p.intra
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_profiles_parse() {
        for name in Hardware::builtin_names() {
            let hw = Hardware::builtin(name).unwrap();
            assert_eq!(hw.name, name);
        }
        let h100 = Hardware::builtin("H100").unwrap();
        assert_eq!(h100.memory_bytes(), 80 << 30);
        assert_eq!(h100.bus_bytes_per_s(Collective::AllReduce, 1), 436e9);
        assert_eq!(h100.bus_bytes_per_s(Collective::AllGather, 64), 11e9);
        assert_eq!(h100.bus_bytes_per_s(Collective::AllReduce, 512), 33e9);
        // Between 2 (362) and 4 (160) nodes, 3 nodes: 362·(160/362)^(log 1.5/log 2).
        let three = h100.bus_bytes_per_s(Collective::AllReduce, 3) / 1e9;
        assert!((three - 224.5).abs() < 0.1, "{three}");
    }

    #[test]
    fn bad_profiles_are_refused() {
        let err = Hardware::builtin("tpu").unwrap_err().to_string();
        assert!(err.contains("h100") && err.contains("cpu-local"), "{err}");
        let text = include_str!("../hardware/h100.toml").replace("[436.0, ", "[-1.0, ");
        let err = Hardware::from_toml(&text).unwrap_err().to_string();
        assert!(err.contains("all_reduce"), "{err}");
    }
}
