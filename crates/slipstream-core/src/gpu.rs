//! The GPUs of this machine, and which one each replica of a GPU stage gets.
//!
//! A stage declared with `device="cuda"` (or `"cuda:N"`) runs each replica's
//! worker with `CUDA_VISIBLE_DEVICES=<uuid>`: the worker sees exactly one
//! device, as `cuda:0`, whatever its place in the machine. UUIDs rather
//! than indices because they name MIG slices too (`MIG-…`), and because
//! CUDA's own index order (fastest first) need not be `nvidia-smi`'s (PCI
//! bus order). The list comes from `nvidia-smi -L`, read once per process:
//! the cluster's member records carry the same lines as the node's
//! inventory.
//!
//! A GPU split into MIG slices offers its slices, not itself: with MIG on,
//! CUDA can only run on a slice. Replicas of a stage asking for any GPU
//! take the device with the fewest of the stage's replicas on this node
//! (a restarted worker keeps its device; a replica replacing one takes the
//! device it left), among this machine's devices or the devices a plan
//! bound the stage to (its `devices`, the slices `slipstream plan` chose
//! for it; on a cluster node, the plan record's for that node). A replica
//! on a device a new binding leaves out is replaced, make before break.
//! `cuda:N` pins every replica to the Nth device of the list.
//! A stage that asks for a GPU on a machine without one fails to start
//! with a message that says so, rather than running on the CPU unnoticed.

use std::sync::OnceLock;

/// One device a worker can be bound to: a whole GPU, or a MIG slice.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gpu {
    /// Its place in [`devices`]' list (what `cuda:N` names).
    pub index: usize,
    /// `GPU-…` or `MIG-…` (older drivers: `MIG-GPU-…/gi/ci`).
    pub uuid: String,
    /// The model, and the MIG profile for a slice (`NVIDIA A100-SXM4-40GB MIG 1g.5gb`).
    pub name: String,
}

/// What a stage asks for (`StageSpec::device`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Want {
    /// The CPU (default).
    #[default]
    Cpu,
    /// Any GPU: replicas take them round-robin.
    AnyGpu,
    /// The Nth device of this machine's list.
    Gpu(usize),
}

impl Want {
    /// `None`/`"cpu"`, `"cuda"`, or `"cuda:N"`.
    pub fn parse(device: Option<&str>) -> Result<Want, String> {
        match device.map(str::trim) {
            None | Some("cpu") => Ok(Want::Cpu),
            Some("cuda") => Ok(Want::AnyGpu),
            Some(d) => d
                .strip_prefix("cuda:")
                .and_then(|n| n.parse::<usize>().ok())
                .map(Want::Gpu)
                .ok_or_else(|| format!("device {d:?} is not one of \"cpu\", \"cuda\" or \"cuda:N\"")),
        }
    }

    /// Whether it wants a GPU.
    pub fn is_gpu(self) -> bool {
        self != Want::Cpu
    }

    /// As declared: `cpu`, `cuda` or `cuda:N`.
    pub fn label(self) -> String {
        match self {
            Want::Cpu => "cpu".into(),
            Want::AnyGpu => "cuda".into(),
            Want::Gpu(n) => format!("cuda:{n}"),
        }
    }
}

/// The devices `nvidia-smi -L` lists, in its order. Lines it does not
/// recognise are skipped.
///
/// ```text
/// GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77)
///   MIG 3g.20gb     Device  0: (UUID: MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f)
/// GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-2b5e2b3a-…)
/// ```
pub fn parse(text: &str) -> Vec<Gpu> {
    // (whole GPU, its MIG slices), in order.
    let mut found: Vec<(Gpu, Vec<Gpu>)> = Vec::new();
    for line in text.lines().map(str::trim) {
        let Some((head, rest)) = line.split_once("(UUID:") else { continue };
        let uuid = rest.trim().trim_end_matches(')').trim().to_string();
        if uuid.is_empty() {
            continue;
        }
        if line.starts_with("GPU ") {
            let name = head.split_once(':').map_or("", |(_, n)| n).trim().to_string();
            found.push((Gpu { index: 0, uuid, name }, Vec::new()));
        } else if let Some(profile) = line.strip_prefix("MIG ") {
            let Some((gpu, slices)) = found.last_mut() else { continue };
            let profile = profile.split_whitespace().next().unwrap_or("");
            slices.push(Gpu { index: 0, uuid, name: format!("{} MIG {profile}", gpu.name) });
        }
    }
    let mut out: Vec<Gpu> =
        found.into_iter().flat_map(|(gpu, slices)| if slices.is_empty() { vec![gpu] } else { slices }).collect();
    for (i, g) in out.iter_mut().enumerate() {
        g.index = i;
    }
    out
}

/// The device for a replica of a stage that wants `want`, among `gpus`
/// (or those of them `bound` names, when it names any): the one it is on
/// (`current`) while that is still a candidate, else the candidate with
/// the fewest of the stage's other replicas on it (`others(index)`), the
/// first in order among equals. `Ok(None)` for a CPU stage; Err says why
/// there is none.
pub fn assign<'a>(
    want: Want,
    current: Option<usize>,
    bound: &[usize],
    gpus: &'a [Gpu],
    others: impl Fn(usize) -> usize,
) -> Result<Option<&'a Gpu>, String> {
    match want {
        Want::Cpu => Ok(None),
        _ if gpus.is_empty() => Err(format!(
            "it asks for device=\"{}\", but this machine has no GPU ({}); serve it on a machine with one, \
             or declare device=\"cpu\"",
            want.label(),
            local_note()
        )),
        Want::AnyGpu => {
            if let Some(&n) = bound.iter().find(|&&n| n >= gpus.len()) {
                return Err(format!(
                    "its plan binds it to cuda:{n}, but this machine has {} GPU device(s)",
                    gpus.len()
                ));
            }
            let all: Vec<usize> = (0..gpus.len()).collect();
            let candidates = if bound.is_empty() { &all[..] } else { bound };
            let pick = match current.filter(|c| candidates.contains(c)) {
                Some(c) => c,
                None => *candidates.iter().min_by_key(|&&n| others(n)).expect("candidates are never empty"),
            };
            Ok(Some(&gpus[pick]))
        }
        Want::Gpu(n) => gpus.get(n).map(Some).ok_or_else(|| {
            let have: Vec<String> = gpus.iter().map(|g| format!("cuda:{} {} ({})", g.index, g.name, g.uuid)).collect();
            format!(
                "it asks for device=\"cuda:{n}\", but this machine has {} GPU device(s): {}",
                gpus.len(),
                have.join(", ")
            )
        }),
    }
}

struct Local {
    lines: Vec<String>,
    gpus: Vec<Gpu>,
    /// Why the list is empty, when `nvidia-smi` could not tell.
    note: String,
}

fn local() -> &'static Local {
    static LOCAL: OnceLock<Local> = OnceLock::new();
    LOCAL.get_or_init(|| match std::process::Command::new("nvidia-smi").arg("-L").output() {
        Ok(o) if o.status.success() => {
            let text = String::from_utf8_lossy(&o.stdout);
            Local {
                lines: text.lines().map(|l| l.trim().to_string()).filter(|l| !l.is_empty()).collect(),
                gpus: parse(&text),
                note: "`nvidia-smi -L` lists none".into(),
            }
        }
        Ok(o) => Local {
            lines: vec![],
            gpus: vec![],
            note: format!(
                "`nvidia-smi -L` failed: {}",
                String::from_utf8_lossy(&o.stderr).trim().lines().next().unwrap_or("no message")
            ),
        },
        Err(e) => Local { lines: vec![], gpus: vec![], note: format!("`nvidia-smi` cannot be run: {e}") },
    })
}

/// This machine's GPU devices (whole GPUs and MIG slices), detected once.
pub fn devices() -> &'static [Gpu] {
    &local().gpus
}

/// `nvidia-smi -L`'s lines as they are (the cluster's inventory); none without GPUs.
pub fn inventory() -> &'static [String] {
    &local().lines
}

fn local_note() -> &'static str {
    &local().note
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIXED: &str = "GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77)
  MIG 3g.20gb     Device  0: (UUID: MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f)
  MIG 1g.5gb      Device  1: (UUID: MIG-cba663e8-9bed-5b25-b243-5985ef7c9beb)
GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-2b5e2b3a-1111-2222-3333-444455556666)
GPU 2: NVIDIA A30 (UUID: GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee)
  MIG 1g.6gb Device 0: (UUID: MIG-GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee/7/0)
";

    #[test]
    fn parses_whole_gpus_and_mig_slices() {
        let g = parse(MIXED);
        let got: Vec<(usize, &str, &str)> = g.iter().map(|g| (g.index, g.uuid.as_str(), g.name.as_str())).collect();
        assert_eq!(
            got,
            vec![
                (0, "MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f", "NVIDIA A100-SXM4-40GB MIG 3g.20gb"),
                (1, "MIG-cba663e8-9bed-5b25-b243-5985ef7c9beb", "NVIDIA A100-SXM4-40GB MIG 1g.5gb"),
                (2, "GPU-2b5e2b3a-1111-2222-3333-444455556666", "NVIDIA H100 80GB HBM3"),
                // An older driver's MIG UUID form.
                (3, "MIG-GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee/7/0", "NVIDIA A30 MIG 1g.6gb"),
            ]
        );
        assert!(parse("").is_empty());
        assert!(parse("No devices found.\n").is_empty());
    }

    /// Replicas started one after another, each seeing the ones before it.
    fn spread(want: Want, bound: &[usize], g: &[Gpu], n: usize) -> Vec<usize> {
        let mut on: Vec<usize> = Vec::new();
        for _ in 0..n {
            let d = assign(want, None, bound, g, |i| on.iter().filter(|&&x| x == i).count()).unwrap().unwrap();
            on.push(d.index);
        }
        on
    }

    #[test]
    fn replicas_spread_over_the_devices_or_take_the_one_named() {
        let g = parse(MIXED);
        assert_eq!(spread(Want::AnyGpu, &[], &g, 6), vec![0, 1, 2, 3, 0, 1]);
        assert_eq!(spread(Want::Gpu(2), &[], &g, 3), vec![2, 2, 2]);
        assert_eq!(assign(Want::Cpu, None, &[], &[], |_| 0).unwrap(), None);
        let err = assign(Want::Gpu(9), None, &[], &g, |_| 0).unwrap_err();
        assert!(err.contains("cuda:9") && err.contains("4 GPU device(s)"), "{err}");
        let err = assign(Want::AnyGpu, None, &[], &[], |_| 0).unwrap_err();
        assert!(err.contains("no GPU") && err.contains("device=\"cuda\""), "{err}");
        // A restarted worker keeps its device; a replica replacing one takes the device it left.
        assert_eq!(assign(Want::AnyGpu, Some(3), &[], &g, |_| 9).unwrap().unwrap().index, 3);
        let on = [0, 2, 3];
        let free = assign(Want::AnyGpu, None, &[], &g, |i| on.iter().filter(|&&x| x == i).count()).unwrap();
        assert_eq!(free.unwrap().index, 1);
    }

    #[test]
    fn a_plan_s_binding_gives_each_replica_one_of_its_slices() {
        let g = parse(MIXED);
        assert_eq!(spread(Want::AnyGpu, &[3, 1], &g, 4), vec![3, 1, 3, 1]);
        // A device the binding no longer names is left for one it does.
        assert_eq!(assign(Want::AnyGpu, Some(0), &[3, 1], &g, |_| 0).unwrap().unwrap().index, 3);
        let err = assign(Want::AnyGpu, None, &[7], &g, |_| 0).unwrap_err();
        assert!(err.contains("cuda:7") && err.contains("4 GPU device(s)"), "{err}");
    }

    #[test]
    fn parses_device_names() {
        assert_eq!(Want::parse(None), Ok(Want::Cpu));
        assert_eq!(Want::parse(Some("cpu")), Ok(Want::Cpu));
        assert_eq!(Want::parse(Some("cuda")), Ok(Want::AnyGpu));
        assert_eq!(Want::parse(Some("cuda:1")), Ok(Want::Gpu(1)));
        for bad in ["gpu", "cuda:", "cuda:-1", "cuda:x", "tpu"] {
            assert!(Want::parse(Some(bad)).is_err(), "{bad}");
        }
    }
}
