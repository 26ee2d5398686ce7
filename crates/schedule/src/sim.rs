//! Executes a schedule's action lists against per-action costs, without tensors.

use std::collections::{HashMap, VecDeque};

use serde::{Deserialize, Serialize};

use crate::action::Flow;
use crate::schedule::peak_of;
use crate::{Action, Placement, Schedule, ScheduleError, Stuck};

/// Time of each action, in any unit (all that matters is ratios).
///
/// Costs are per `(micro-batch, chunk)`: interleaved chunks hold `1/v` of a rank's layers, so
/// to compare schedules at equal work divide the costs by `v`. `backward` is used by AFAB,
/// 1F1B and interleaved; `backward_input` and `backward_weight` by zero bubble only.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Costs {
    /// One forward. Default 1.
    pub forward: f64,
    /// One full backward (input and weight gradients). Default 2, i.e. `2·forward`.
    pub backward: f64,
    /// Zero bubble's `B`, the input gradient. Default 1.
    pub backward_input: f64,
    /// Zero bubble's `W`, the weight gradient. Default 1.
    pub backward_weight: f64,
    /// Latency of one point-to-point message, from its send to its earliest receive. The
    /// sender never waits (sends are buffered); the receiver sees it as idle time. Default 0.
    pub p2p: f64,
}

impl Default for Costs {
    fn default() -> Self {
        Costs::with_forward(1.0)
    }
}

impl Costs {
    /// Playbook costs for a forward of `forward`: backward `2·forward`, `B` and `W` one
    /// forward each, free communication.
    pub fn with_forward(forward: f64) -> Costs {
        Costs {
            forward,
            backward: 2.0 * forward,
            backward_input: forward,
            backward_weight: forward,
            p2p: 0.0,
        }
    }

    fn validate(&self) -> Result<(), ScheduleError> {
        let fields = [
            ("forward", self.forward),
            ("backward", self.backward),
            ("backward_input", self.backward_input),
            ("backward_weight", self.backward_weight),
            ("p2p", self.p2p),
        ];
        for (field, value) in fields {
            if !value.is_finite() || value < 0.0 {
                return Err(ScheduleError::InvalidCost { field, value });
            }
        }
        Ok(())
    }

    /// Duration of a computation action; 0 for sends and receives.
    pub fn of(&self, action: &Action) -> f64 {
        match action {
            Action::Forward { .. } => self.forward,
            Action::Backward { .. } => self.backward,
            Action::BackwardInput { .. } => self.backward_input,
            Action::BackwardWeight { .. } => self.backward_weight,
            _ => 0.0,
        }
    }
}

/// One executed action with its start and end time.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Timed {
    /// The action.
    pub action: Action,
    /// When the rank reached it (for a receive: when it started waiting).
    pub start: f64,
    /// When it completed (for a receive: when the message was in hand).
    pub end: f64,
}

/// What one rank did in the simulation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RankStats {
    /// When the rank's last action completed.
    pub finish: f64,
    /// Time spent computing.
    pub busy: f64,
    /// Time not computing within the step: `makespan − busy` (the rank waits for the slowest
    /// rank before the optimizer step).
    pub idle: f64,
    /// Peak `(micro-batch, chunk)` activation sets alive, as [`Schedule::peak_in_flight`].
    pub peak_in_flight: usize,
    /// Every action with its timing, in list order.
    pub timeline: Vec<Timed>,
}

/// The outcome of [`simulate`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Simulation {
    /// Step time: the latest finish over all ranks (the optimizer step waits for all).
    pub makespan: f64,
    /// Bubble-free step time: the busiest rank's compute time, `m·v·(F + B)` (zero bubble:
    /// `m·(F + B_input + W)`) for every built schedule.
    pub ideal: f64,
    /// Per rank, indexed by rank.
    pub ranks: Vec<RankStats>,
}

impl Simulation {
    /// `(makespan − ideal)/ideal`: bubble time over ideal time, as in the playbook, which
    /// gives `(p−1)/m` for AFAB and 1F1B and `(p−1)/(v·m)` for interleaved.
    pub fn bubble_fraction(&self) -> f64 {
        (self.makespan - self.ideal) / self.ideal
    }
}

/// Message identity shared by both ends: flow, boundary virtual stage, micro-batch.
type Key = (Flow, usize, usize);

/// Arrival times of posted, not yet received messages, with their senders.
type Mailbox = HashMap<Key, VecDeque<(f64, usize, Action)>>;

/// Where every rank stands: its next action, its clock, its compute time so far and what
/// it has done.
struct Ranks {
    pc: Vec<usize>,
    clock: Vec<f64>,
    busy: Vec<f64>,
    timeline: Vec<Vec<Timed>>,
}

impl Ranks {
    /// Runs `rank`'s actions from its next one until a receive finds no message or the list
    /// ends; returns whether it did anything.
    fn advance(
        &mut self,
        rank: usize,
        lists: &[Vec<Action>],
        costs: &Costs,
        mail: &mut Mailbox,
        placement: Placement,
    ) -> bool {
        let p = lists.len();
        let mut moved = false;
        while let Some(&action) = lists[rank].get(self.pc[rank]) {
            let start = self.clock[rank];
            match (action.edge(rank, p, placement), action) {
                (Some(key), Action::RecvActivation { .. } | Action::RecvGrad { .. }) => {
                    let key = (key.0, key.1, action.mb());
                    let Some((arrival, ..)) = mail.get_mut(&key).and_then(VecDeque::pop_front)
                    else {
                        break;
                    };
                    self.clock[rank] = start.max(arrival);
                }
                (Some(key), _) => {
                    let key = (key.0, key.1, action.mb());
                    let arrival = start + costs.p2p;
                    mail.entry(key)
                        .or_default()
                        .push_back((arrival, rank, action));
                }
                (None, _) => {
                    let cost = costs.of(&action);
                    self.clock[rank] += cost;
                    self.busy[rank] += cost;
                }
            }
            self.timeline[rank].push(Timed {
                action,
                start,
                end: self.clock[rank],
            });
            self.pc[rank] += 1;
            moved = true;
        }
        moved
    }

    /// Whether every rank has run its whole list.
    fn done(&self, lists: &[Vec<Action>]) -> bool {
        (0..lists.len()).all(|r| self.pc[r] == lists[r].len())
    }

    /// The deadlock: each rank not done, with the action it waits at.
    fn deadlock(&self, lists: &[Vec<Action>]) -> ScheduleError {
        let stuck = (0..lists.len())
            .filter(|&r| self.pc[r] < lists[r].len())
            .map(|rank| Stuck {
                rank,
                index: self.pc[rank],
                action: lists[rank][self.pc[rank]],
            })
            .collect();
        ScheduleError::Deadlock { stuck }
    }
}

/// The error for messages sent and never received: their count and the first of them (by
/// rank, micro-batch, chunk); `None` when the mailbox is empty.
fn unmatched(mail: Mailbox) -> Option<ScheduleError> {
    let left: Vec<(usize, Action)> = mail
        .into_values()
        .flatten()
        .map(|(_, rank, action)| (rank, action))
        .collect();
    let &(rank, action) = left.iter().min_by_key(|(r, a)| (*r, a.mb(), a.chunk()))?;
    let to = action.peer().unwrap_or(rank);
    Some(ScheduleError::UnmatchedSend {
        count: left.len(),
        rank,
        action,
        to,
    })
}

/// Runs every rank's list in order: computations take their cost, receives block until the
/// matching send has been posted plus `costs.p2p`, sends never block. Fails with
/// [`ScheduleError::Deadlock`] (naming each blocked rank and its next action) when no rank
/// can move, and with [`ScheduleError::UnmatchedSend`] when messages are left unreceived.
pub fn simulate(schedule: &Schedule, costs: &Costs) -> Result<Simulation, ScheduleError> {
    costs.validate()?;
    let p = schedule.stages();
    let lists = schedule.ranks();
    let placement = schedule.kind().placement();
    let mut ranks = Ranks {
        pc: vec![0usize; p],
        clock: vec![0.0f64; p],
        busy: vec![0.0f64; p],
        timeline: lists.iter().map(|l| Vec::with_capacity(l.len())).collect(),
    };
    let mut mail = Mailbox::new();
    loop {
        let mut moved = false;
        for rank in 0..p {
            moved |= ranks.advance(rank, lists, costs, &mut mail, placement);
        }
        if ranks.done(lists) {
            break;
        }
        if !moved {
            return Err(ranks.deadlock(lists));
        }
    }
    if let Some(e) = unmatched(mail) {
        return Err(e);
    }
    let Ranks {
        clock,
        busy,
        timeline,
        ..
    } = ranks;
    let makespan = clock.iter().copied().fold(0.0, f64::max);
    let ideal = busy.iter().copied().fold(0.0, f64::max);
    if ideal <= 0.0 {
        return Err(ScheduleError::ZeroIdealTime);
    }
    let ranks = timeline
        .into_iter()
        .enumerate()
        .map(|(rank, timeline)| RankStats {
            finish: clock[rank],
            busy: busy[rank],
            idle: makespan - busy[rank],
            peak_in_flight: peak_of(&lists[rank]),
            timeline,
        })
        .collect();
    Ok(Simulation {
        makespan,
        ideal,
        ranks,
    })
}

impl Schedule {
    /// The bubble fraction `(makespan − ideal)/ideal` under `costs`; see [`simulate`].
    pub fn bubble_fraction(&self, costs: &Costs) -> Result<f64, ScheduleError> {
        Ok(simulate(self, costs)?.bubble_fraction())
    }
}
