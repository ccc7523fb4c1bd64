//! Data-parallel training over MPI: `mpirun -np N cadenza train ...` trains one model on
//! N processes (ranks), on one machine or across machines with a hostfile.
//!
//! `tch` exposes neither torch.distributed process groups nor gradient hooks, so the
//! collectives are MPI's (the `mpi` crate, behind the cargo feature `distributed`), after
//! the designs of Horovod (an MPI launcher, all-reduces over fused buffers) and PyTorch
//! DDP (parameters broadcast from rank 0, gradients in buckets of 25 MiB):
//!
//! * Rank 0 broadcasts every parameter and FAVOR+ training projection before the first
//!   step, so all ranks start from the same bits whatever their seeds or files.
//! * Every rank draws the whole global batch of the step (a cheap pure function of
//!   (seed, step), [`super::data::Batcher::batch`]) and keeps its rows, [`Dist::rows`]:
//!   N ranks with batch B/N see exactly the windows one process with batch B sees.
//! * Each rank backpropagates its mean loss weighted by its share of the global batch's
//!   target tokens ([`target_weight`]); the gradients are then summed over the ranks in
//!   flattened f32 buckets ([`Dist::sum_gradients`], staged through host memory), so every
//!   rank holds the gradient of the global mean loss, clips it by the global norm and
//!   applies the same AdamW step. The model's own random draws of a step (SPE noise,
//!   feature redraws) come first from the same seed, so they agree across ranks; dropout
//!   masks are drawn per rank (the same distribution, other draws than one process).
//! * Rank 0 alone writes the run folder (checkpoints, metrics, `best/`, plots); the other
//!   ranks read it (a resumed run's config and checkpoint), so it must be on a file system
//!   every machine sees. A checkpoint holds no trace of the number of ranks: `--resume`
//!   works with any N that divides the batch.
//! * The interrupt flag and the loss travel in one all-reduce per step, so all ranks stop
//!   at the same step, after rank 0 saved its checkpoint.
//!
//! Failure behaviour: a rank that exits (an error, a crash, a kill) makes `mpirun` end
//! the others at once (an error calls `MPI_Abort` after printing its message, [`Session::fail`]).
//! A rank that hangs leaves the others blocked in a collective of the training loop: a
//! watchdog thread ends the job with a message naming the collective after
//! `--rank-timeout` seconds (default [`DEFAULT_RANK_TIMEOUT_S`]). Rank 0 validates and
//! saves between two collectives, so the timeout must exceed the longest validation plus
//! checkpoint. Checkpoints are written whole before they replace the last one
//! (`checkpoint::save_checkpoint`), so a job ended at any point leaves the last valid.
//! Ranks whose configuration, vocabulary, data or program differ are refused before the
//! first step ([`Dist::check_same`]).
//!
//! Without the feature, or without an MPI launcher in the environment, [`Dist`] is a
//! single process and every operation here is the identity.

use std::ops::Range;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use tch::{Device, Kind, Tensor};

use crate::tokenizer::PAD_ID;

/// Seconds a rank waits in a collective of the training loop before it ends the job.
pub const DEFAULT_RANK_TIMEOUT_S: u64 = 600;
/// Bytes of gradients summed per all-reduce (PyTorch DDP's default bucket).
pub const BUCKET_BYTES: usize = 25 << 20;

/// Environment variables by which MPI launchers announce the number of processes:
/// Open MPI, MPICH / Intel MPI (Hydra), PMIx (Slurm's srun).
const LAUNCHER_SIZE_VARS: [&str; 3] = ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"];
/// ... and the rank among the processes of one machine.
#[cfg_attr(not(feature = "distributed"), allow(dead_code))]
const LOCAL_RANK_VARS: [&str; 4] = [
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MPI_LOCALRANKID",
    "PMIX_LOCAL_RANK",
    "SLURM_LOCALID",
];

/// Where this process stands in a data-parallel run; the default is a single process.
#[derive(Debug, Clone)]
pub struct Dist {
    rank: usize,
    size: usize,
    local_rank: usize,
    timeout: Duration,
    watchdog: Option<std::sync::Arc<watchdog::Watchdog>>,
}

impl Default for Dist {
    fn default() -> Self {
        Dist {
            rank: 0,
            size: 1,
            local_rank: 0,
            timeout: Duration::from_secs(DEFAULT_RANK_TIMEOUT_S),
            watchdog: None,
        }
    }
}

/// The number of processes an MPI launcher announced, if one started this process.
pub fn launcher_size() -> Option<(String, String)> {
    LAUNCHER_SIZE_VARS
        .iter()
        .find_map(|v| std::env::var(v).ok().map(|s| (v.to_string(), s)))
}

#[cfg_attr(not(feature = "distributed"), allow(dead_code))]
fn local_rank_from_env() -> Option<usize> {
    LOCAL_RANK_VARS
        .iter()
        .find_map(|v| std::env::var(v).ok()?.parse().ok())
}

/// The rows `[rank * B / N, (rank + 1) * B / N)` of a global batch of `batch` rows.
pub fn rows(rank: usize, size: usize, batch: usize) -> Range<usize> {
    rank * batch / size..(rank + 1) * batch / size
}

/// Share of the global batch's next-token targets (non-PAD) that `rows` hold: the weight
/// that makes the sum over ranks of weighted per-rank mean losses the global mean loss.
/// `ids` is the global batch, `window` ids per row. 0 when no row holds a target.
pub fn target_weight(ids: &[i64], window: usize, rows: Range<usize>) -> f64 {
    let count = |r: Range<usize>| -> usize {
        r.map(|i| {
            ids[i * window + 1..(i + 1) * window]
                .iter()
                .filter(|&&t| t != PAD_ID as i64)
                .count()
        })
        .sum()
    };
    let total = count(0..ids.len() / window.max(1));
    if total == 0 {
        return 0.0;
    }
    count(rows) as f64 / total as f64
}

/// FNV-1a over bytes: a fingerprint that is the same on every platform.
pub fn fingerprint(bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes.into_iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Fingerprint of token sequences (their lengths and ids).
pub fn fingerprint_ids<'a>(seqs: impl IntoIterator<Item = &'a [u32]>) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for s in seqs {
        for x in std::iter::once(s.len() as u32).chain(s.iter().copied()) {
            // one multiply per id: the whole dataset is hashed at start
            h = (h ^ x as u64).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// The first item whose fingerprint on some rank differs from rank 0's: (item, rank).
/// `all` holds every rank's fingerprints in rank order, `names.len()` per rank.
pub fn first_mismatch<'a>(names: &[&'a str], all: &[u64]) -> Option<(&'a str, usize)> {
    let n = names.len();
    let ranks = all.len() / n.max(1);
    (1..ranks).find_map(|r| {
        (0..n)
            .find(|&i| all[r * n + i] != all[i])
            .map(|i| (names[i], r))
    })
}

impl Dist {
    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// Whether this rank writes the run folder and reports (rank 0).
    pub fn is_root(&self) -> bool {
        self.rank == 0
    }

    pub fn is_single(&self) -> bool {
        self.size == 1
    }

    /// "rank 1/4: " for messages of a run of several ranks, "" otherwise.
    pub fn tag(&self) -> String {
        if self.is_single() {
            String::new()
        } else {
            format!("rank {}/{}: ", self.rank, self.size)
        }
    }

    /// Refuses a global batch that the ranks cannot share evenly.
    pub fn check_batch(&self, batch: i64) -> Result<()> {
        if batch % self.size as i64 != 0 {
            bail!(
                "--batch {batch} cannot be shared by {} ranks: give a batch that is a multiple \
                 of the number of ranks (each rank computes batch / ranks windows)",
                self.size
            );
        }
        Ok(())
    }

    /// This rank's rows of a global batch of `batch` rows.
    pub fn rows(&self, batch: usize) -> Range<usize> {
        rows(self.rank, self.size, batch)
    }

    /// The device of this rank: with several ranks and `--device cuda` (or `auto` finding
    /// CUDA), GPU number `local rank` of its machine; an explicit `cuda:N` or the CPU as
    /// given.
    pub fn device(&self, asked: Option<&str>, parsed: Device) -> Result<Device> {
        let explicit = asked.is_some_and(|a| a.starts_with("cuda:"));
        match parsed {
            Device::Cuda(_) if !self.is_single() && !explicit => {
                let n = tch::Cuda::device_count().max(0) as usize;
                if self.local_rank >= n {
                    bail!(
                        "{}local rank {} has no GPU of its own (this machine has {n}): start \
                         at most one rank per GPU on each machine",
                        self.tag(),
                        self.local_rank
                    );
                }
                Ok(Device::Cuda(self.local_rank))
            }
            d => Ok(d),
        }
    }

    /// Arms the watchdog for a collective named `what` (see the module docs); the
    /// returned guard disarms it.
    fn guard(&self, what: &'static str) -> Option<watchdog::Armed> {
        self.watchdog
            .as_ref()
            .map(|w| w.arm(what, Instant::now() + self.timeout))
    }

    /// Refuses to go on unless every rank has rank 0's fingerprint of each named item.
    pub fn check_same(&self, items: &[(&str, u64)]) -> Result<()> {
        if self.is_single() {
            return Ok(());
        }
        let mine: Vec<u64> = items.iter().map(|i| i.1).collect();
        let all = comm::all_gather(&mine, self.size);
        let names: Vec<&str> = items.iter().map(|i| i.0).collect();
        if let Some((what, r)) = first_mismatch(&names, &all) {
            bail!(
                "{}rank {r} has another {what} than rank 0: every rank must be started with the \
                 same flags, vocabulary, data and build of cadenza",
                self.tag()
            );
        }
        Ok(())
    }

    /// Waits until every rank is here: before the training loop, the other ranks
    /// wait for rank 0 to prepare the run folder. Like every collective, it ends the
    /// job after `--rank-timeout` seconds (a rank that hangs before it).
    pub fn barrier(&self) {
        if !self.is_single() {
            let _armed = self.guard("the start-up barrier (rank 0 preparing the run folder)");
            comm::barrier();
        }
    }

    /// Overwrites `tensors` on every rank with rank 0's values (byte for byte).
    pub fn broadcast(&self, tensors: &[Tensor]) -> Result<()> {
        if self.is_single() {
            return Ok(());
        }
        let _g = self.guard("the broadcast of the initial parameters");
        tch::no_grad(|| -> Result<()> {
            for t in tensors {
                let host = t.to_device(Device::Cpu).contiguous();
                let bytes = host.numel() * host.kind().elt_size_in_bytes();
                let mut buf = vec![0u8; bytes];
                host.copy_data_u8(&mut buf, host.numel());
                comm::broadcast_bytes(&mut buf);
                let back = Tensor::from_data_size(&buf, &host.size(), host.kind());
                let mut t = t.shallow_clone();
                t.copy_(&back.to_device(t.device()));
            }
            Ok(())
        })
    }

    /// Sums the gradients of `params` over the ranks, in flattened f32 buckets of at most
    /// [`BUCKET_BYTES`] each; returns the time spent communicating. Every rank must pass
    /// the same parameters in the same order (the fingerprint check ensures the model).
    pub fn sum_gradients(&self, params: &[Tensor]) -> Result<Duration> {
        if self.is_single() {
            return Ok(Duration::ZERO);
        }
        let grads: Vec<Tensor> = params
            .iter()
            .map(|p| p.grad())
            .filter(|g| g.defined())
            .collect();
        let mut spent = Duration::ZERO;
        let cap = BUCKET_BYTES / 4;
        let mut start = 0;
        while start < grads.len() {
            let mut end = start;
            let mut n = 0usize;
            while end < grads.len() && (end == start || n + grads[end].numel() <= cap) {
                n += grads[end].numel();
                end += 1;
            }
            spent += self.sum_bucket(&grads[start..end])?;
            start = end;
        }
        Ok(spent)
    }

    fn sum_bucket(&self, grads: &[Tensor]) -> Result<Duration> {
        tch::no_grad(|| -> Result<Duration> {
            let flat: Vec<Tensor> = grads
                .iter()
                .map(|g| g.to_kind(Kind::Float).reshape([-1]))
                .collect();
            let host = Tensor::cat(&flat, 0).to_device(Device::Cpu);
            let send = Vec::<f32>::try_from(&host)
                .map_err(|e| anyhow::anyhow!("gradient bucket to host memory: {e}"))?;
            let mut recv = vec![0f32; send.len()];
            let t0 = Instant::now();
            {
                let _g = self.guard("the all-reduce of the gradients");
                comm::sum_f32(&send, &mut recv);
            }
            let spent = t0.elapsed();
            let summed = Tensor::from_slice(&recv).to_device(grads[0].device());
            let mut at = 0;
            for g in grads {
                let n = g.numel() as i64;
                let mut g = g.shallow_clone();
                g.copy_(&summed.narrow(0, at, n).view_as(&g).to_kind(g.kind()));
                at += n;
            }
            Ok(spent)
        })
    }

    /// Sums `xs` over the ranks in place (the step's loss and stop flag).
    pub fn sum_scalars(&self, xs: &mut [f64]) {
        if self.is_single() {
            return;
        }
        let _g = self.guard("the all-reduce of the step's loss");
        let send = xs.to_vec();
        comm::sum_f64(&send, xs);
    }
}

/// The MPI environment of the process: initialized by [`Session::start`] when an MPI
/// launcher started it, finalized on drop.
pub struct Session {
    dist: Dist,
    #[cfg(feature = "distributed")]
    _universe: Option<mpi::environment::Universe>,
}

impl Session {
    /// Joins the job an MPI launcher started, or stands alone when there is none.
    /// `timeout`: `--rank-timeout` in seconds.
    pub fn start(timeout: u64) -> Result<Session> {
        if timeout == 0 {
            bail!("--rank-timeout 0: give a number of seconds of at least 1");
        }
        let Some((var, value)) = launcher_size() else {
            return Ok(Session::single());
        };
        Session::join(timeout, &var, &value)
    }

    fn single() -> Session {
        Session {
            dist: Dist::default(),
            #[cfg(feature = "distributed")]
            _universe: None,
        }
    }

    #[cfg(not(feature = "distributed"))]
    fn join(_timeout: u64, var: &str, value: &str) -> Result<Session> {
        if value.trim() == "1" {
            return Ok(Session::single());
        }
        bail!(
            "an MPI launcher started this process ({var}={value}), but this cadenza was built \
             without data-parallel training: build it with `cargo build --release --features \
             distributed` (needs an MPI; `make distributed-test` installs Open MPI)"
        )
    }

    #[cfg(feature = "distributed")]
    fn join(timeout: u64, _var: &str, _value: &str) -> Result<Session> {
        use mpi::environment::Threading;
        use mpi::traits::Communicator;
        // Multiple: the watchdog thread may call MPI_Abort while the main thread waits.
        let Some((universe, _)) = mpi::initialize_with_threading(Threading::Multiple) else {
            bail!("MPI was initialized twice in one process");
        };
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        let dist = Dist {
            rank,
            size,
            local_rank: local_rank_from_env().unwrap_or(0),
            timeout: Duration::from_secs(timeout),
            watchdog: (size > 1).then(|| watchdog::Watchdog::start(rank, size, timeout)),
        };
        Ok(Session {
            dist,
            _universe: Some(universe),
        })
    }

    pub fn dist(&self) -> &Dist {
        &self.dist
    }

    /// Ends the whole job after `message` (a run of several ranks: `MPI_Abort`, so that
    /// no rank waits for this one); a single process returns the error as it is.
    pub fn fail(&self, e: anyhow::Error) -> anyhow::Error {
        if self.dist.is_single() {
            return e;
        }
        let text = format!("{e:#}");
        eprintln!(
            "error: {}{}",
            self.dist.tag(),
            cadenza_core::util::excerpt(&text, cadenza_core::util::MAX_ERROR_CHARS)
        );
        comm::abort(2)
    }
}

/// The MPI calls, one function each; without the feature a run has one rank and none of
/// them is reached ([`Dist`] returns before).
#[cfg(feature = "distributed")]
mod comm {
    use mpi::collective::SystemOperation;
    use mpi::topology::SimpleCommunicator;
    use mpi::traits::*;

    pub fn all_gather(mine: &[u64], size: usize) -> Vec<u64> {
        let mut all = vec![0u64; mine.len() * size];
        SimpleCommunicator::world().all_gather_into(mine, &mut all[..]);
        all
    }

    pub fn barrier() {
        SimpleCommunicator::world().barrier();
    }

    pub fn broadcast_bytes(buf: &mut [u8]) {
        // MPI counts are ints: large tensors go in slices of 1 GiB
        for part in buf.chunks_mut(1 << 30) {
            SimpleCommunicator::world()
                .process_at_rank(0)
                .broadcast_into(part);
        }
    }

    pub fn sum_f32(send: &[f32], recv: &mut [f32]) {
        SimpleCommunicator::world().all_reduce_into(send, recv, SystemOperation::sum());
    }

    pub fn sum_f64(send: &[f64], recv: &mut [f64]) {
        SimpleCommunicator::world().all_reduce_into(send, recv, SystemOperation::sum());
    }

    pub fn abort(code: i32) -> ! {
        SimpleCommunicator::world().abort(code)
    }
}

#[cfg(not(feature = "distributed"))]
mod comm {
    fn unreachable_single() -> ! {
        unreachable!("a build without the `distributed` feature runs one rank")
    }
    pub fn all_gather(_: &[u64], _: usize) -> Vec<u64> {
        unreachable_single()
    }
    pub fn barrier() {
        unreachable_single()
    }
    pub fn broadcast_bytes(_: &mut [u8]) {
        unreachable_single()
    }
    pub fn sum_f32(_: &[f32], _: &mut [f32]) {
        unreachable_single()
    }
    pub fn sum_f64(_: &[f64], _: &mut [f64]) {
        unreachable_single()
    }
    pub fn abort(_: i32) -> ! {
        unreachable_single()
    }
}

/// A thread that ends the job when a collective outlasts its deadline.
mod watchdog {
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    #[derive(Debug)]
    pub struct Watchdog {
        /// The collective waited in and its deadline, while one is.
        armed: Mutex<Option<(&'static str, Instant)>>,
    }

    /// Disarms the watchdog on drop.
    pub struct Armed(Arc<Watchdog>);

    impl Drop for Armed {
        fn drop(&mut self) {
            *self.0.armed.lock().unwrap_or_else(|e| e.into_inner()) = None;
        }
    }

    impl Watchdog {
        #[cfg_attr(not(feature = "distributed"), allow(dead_code))]
        pub fn start(rank: usize, size: usize, timeout: u64) -> Arc<Watchdog> {
            let w = Arc::new(Watchdog {
                armed: Mutex::new(None),
            });
            let seen = w.clone();
            std::thread::spawn(move || loop {
                std::thread::sleep(Duration::from_millis(250));
                let late = *seen.armed.lock().unwrap_or_else(|e| e.into_inner());
                if let Some((what, _)) = late.filter(|l| Instant::now() > l.1) {
                    eprintln!(
                        "error: rank {rank}/{size}: no answer from the other ranks for {timeout} s \
                         in {what}: a rank hangs or died (--rank-timeout {timeout}); ending the \
                         job, the run's last checkpoint stays as it was"
                    );
                    super::comm::abort(3);
                }
            });
            w
        }

        pub fn arm(self: &Arc<Self>, what: &'static str, deadline: Instant) -> Armed {
            *self.armed.lock().unwrap_or_else(|e| e.into_inner()) = Some((what, deadline));
            Armed(self.clone())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_cover_the_batch_once_in_order() {
        for size in 1..=4 {
            let batch = 8;
            let mut next = 0;
            for rank in 0..size {
                let r = rows(rank, size, batch);
                assert_eq!(r.start, next);
                next = r.end;
            }
            assert_eq!(next, batch);
        }
        assert_eq!(rows(1, 2, 8), 4..8);
    }

    #[test]
    fn target_weights_sum_to_one_and_count_only_real_targets() {
        let pad = PAD_ID as i64;
        // 2 rows of window 4: targets are ids 1..4 of each row
        let ids = [5, 6, 7, 8, 5, 6, pad, pad];
        let w0 = target_weight(&ids, 4, 0..1);
        let w1 = target_weight(&ids, 4, 1..2);
        assert!((w0 - 0.75).abs() < 1e-12, "{w0}");
        assert!((w1 - 0.25).abs() < 1e-12, "{w1}");
        assert_eq!(target_weight(&[pad; 8], 4, 0..1), 0.0);
    }

    #[test]
    fn mismatch_names_the_item_and_the_rank() {
        let names = ["configuration", "vocabulary", "data"];
        assert_eq!(first_mismatch(&names, &[1, 2, 3, 1, 2, 3]), None);
        assert_eq!(
            first_mismatch(&names, &[1, 2, 3, 1, 2, 3, 1, 9, 3]),
            Some(("vocabulary", 2))
        );
    }

    #[test]
    fn fingerprints_see_order_and_boundaries() {
        let a: [&[u32]; 2] = [&[1, 2], &[3]];
        let b: [&[u32]; 2] = [&[1], &[2, 3]];
        assert_ne!(fingerprint_ids(a), fingerprint_ids(b));
        assert_eq!(fingerprint_ids(a), fingerprint_ids(a));
        assert_ne!(fingerprint(*b"ab"), fingerprint(*b"ba"));
    }

    #[test]
    fn a_batch_the_ranks_cannot_share_is_refused() {
        let d = Dist {
            size: 3,
            ..Dist::default()
        };
        let e = d.check_batch(8).unwrap_err().to_string();
        assert!(e.contains("--batch 8") && e.contains("3 ranks"), "{e}");
        assert!(d.check_batch(9).is_ok());
    }

    #[test]
    fn a_single_process_keeps_its_device_and_gradients() {
        let d = Dist::default();
        assert_eq!(d.device(Some("cpu"), Device::Cpu).unwrap(), Device::Cpu);
        let p = Tensor::ones([3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        (&p * 2.0).sum(Kind::Float).backward();
        assert_eq!(
            d.sum_gradients(&[p.shallow_clone()]).unwrap(),
            Duration::ZERO
        );
        assert_eq!(Vec::<f32>::try_from(&p.grad()).unwrap(), vec![2.0; 3]);
        assert_eq!(d.tag(), "");
    }
}
