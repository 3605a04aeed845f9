//! Adapter discovery and device creation: the only place that talks to wgpu's instance and adapters.

use crate::backend::BackendError;

/// Which adapters [`WgpuBackend::new`](super::WgpuBackend::new) may pick.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum AdapterKind {
    /// Any adapter, software ones (lavapipe, WARP, SwiftShader) included. Hardware adapters are listed first.
    #[default]
    Any,
    /// Discrete, integrated or virtual GPUs only; CPU/software adapters are skipped.
    HardwareOnly,
}

/// How to choose an adapter: a kind filter, then an index into the filtered list (for example `LOCAL_RANK`).
/// The index wraps around the number of adapters found, so more local ranks than GPUs share them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct AdapterSelection {
    pub kind: AdapterKind,
    pub index: Option<usize>,
}

impl AdapterSelection {
    pub fn any() -> Self {
        AdapterSelection {
            kind: AdapterKind::Any,
            index: None,
        }
    }

    pub fn hardware() -> Self {
        AdapterSelection {
            kind: AdapterKind::HardwareOnly,
            index: None,
        }
    }

    pub fn with_index(self, index: usize) -> Self {
        AdapterSelection {
            index: Some(index),
            ..self
        }
    }
}

/// What `ringtrain info` prints about one adapter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdapterReport {
    /// Position in the list [`list_adapters`] returns (hardware first), the index an [`AdapterSelection`]
    /// with [`AdapterKind::Any`] uses.
    pub index: usize,
    pub name: String,
    /// `Vulkan`, `Metal`, `Dx12`, ...
    pub backend: String,
    /// `DiscreteGpu`, `IntegratedGpu`, `VirtualGpu`, `Cpu`, `Other`.
    pub device_type: String,
    pub driver: String,
    /// A CPU/software implementation (lavapipe and the like): usable, but slower than the CPU backend.
    pub is_software: bool,
    pub max_buffer_size: u64,
    pub max_storage_buffer_binding_size: u64,
    pub max_storage_buffers_per_shader_stage: u32,
    pub max_compute_workgroup_storage_size: u32,
    pub max_compute_invocations_per_workgroup: u32,
    /// Smallest and largest subgroup size, when the adapter offers subgroup operations.
    pub subgroup_sizes: Option<(u32, u32)>,
    /// `None` when the adapter can run ringtrain's kernels, else why not.
    pub unsupported: Option<String>,
}

impl std::fmt::Display for AdapterReport {
    /// One line: `#0 NAME (Vulkan, DiscreteGpu, driver ...): max buffer 2048 MiB, max binding 128 MiB`, plus
    /// `, subgroups of 8-8`, `, software` and `, unusable: REASON` where they apply.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mib = |b: u64| b >> 20;
        write!(
            f,
            "#{} {} ({}, {}, {}): max buffer {} MiB, max binding {} MiB",
            self.index,
            self.name,
            self.backend,
            self.device_type,
            self.driver,
            mib(self.max_buffer_size),
            mib(self.max_storage_buffer_binding_size)
        )?;
        if let Some((lo, hi)) = self.subgroup_sizes {
            write!(f, ", subgroups of {lo}-{hi}")?;
        }
        if self.is_software {
            write!(f, ", software")?;
        }
        if let Some(why) = &self.unsupported {
            write!(f, ", unusable: {why}")?;
        }
        Ok(())
    }
}

/// Storage bindings of the widest kernel (layer-norm backward) plus its uniform.
pub(crate) const NEEDED_STORAGE_BUFFERS: u32 = 8;
pub(crate) const NEEDED_INVOCATIONS: u32 = 256;
pub(crate) const NEEDED_WORKGROUP_STORAGE: u32 = 8192;

fn instance() -> wgpu::Instance {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle_from_env();
    // Only the native compute-capable backends are compiled in (no GL).
    desc.backends &= wgpu::Backends::VULKAN | wgpu::Backends::METAL | wgpu::Backends::DX12;
    wgpu::Instance::new(desc)
}

fn type_rank(t: wgpu::DeviceType) -> u8 {
    match t {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Other => 3,
        wgpu::DeviceType::Cpu => 4,
    }
}

fn is_software(info: &wgpu::AdapterInfo) -> bool {
    info.device_type == wgpu::DeviceType::Cpu
}

/// Why an adapter cannot run the kernels, if it cannot.
pub(crate) fn unsupported_reason(adapter: &wgpu::Adapter) -> Option<String> {
    let limits = adapter.limits();
    let down = adapter.get_downlevel_capabilities();
    if !down.flags.contains(wgpu::DownlevelFlags::COMPUTE_SHADERS) {
        return Some("no compute shaders".into());
    }
    if limits.max_storage_buffers_per_shader_stage < NEEDED_STORAGE_BUFFERS {
        return Some(format!(
            "{} storage buffers per shader stage, {} needed",
            limits.max_storage_buffers_per_shader_stage, NEEDED_STORAGE_BUFFERS
        ));
    }
    if limits.max_compute_invocations_per_workgroup < NEEDED_INVOCATIONS || limits.max_compute_workgroup_size_x < 256 {
        return Some(format!(
            "workgroups of {} invocations, {} needed",
            limits.max_compute_invocations_per_workgroup, NEEDED_INVOCATIONS
        ));
    }
    if limits.max_compute_workgroup_storage_size < NEEDED_WORKGROUP_STORAGE {
        return Some(format!(
            "{} bytes of workgroup memory, {} needed",
            limits.max_compute_workgroup_storage_size, NEEDED_WORKGROUP_STORAGE
        ));
    }
    None
}

/// Every adapter wgpu finds, hardware first (discrete, integrated, virtual, other, CPU), in a stable order.
fn sorted_adapters(instance: &wgpu::Instance) -> Vec<wgpu::Adapter> {
    let mut adapters = pollster::block_on(instance.enumerate_adapters(wgpu::Backends::all()));
    adapters.sort_by_key(|a| {
        let info = a.get_info();
        (type_rank(info.device_type), info.backend as u8, info.name.clone())
    });
    adapters
}

fn report(index: usize, adapter: &wgpu::Adapter) -> AdapterReport {
    let info = adapter.get_info();
    let limits = adapter.limits();
    AdapterReport {
        index,
        name: info.name.clone(),
        backend: format!("{:?}", info.backend),
        device_type: format!("{:?}", info.device_type),
        driver: format!("{} {}", info.driver, info.driver_info).trim().to_string(),
        is_software: is_software(&info),
        max_buffer_size: limits.max_buffer_size,
        max_storage_buffer_binding_size: limits.max_storage_buffer_binding_size,
        max_storage_buffers_per_shader_stage: limits.max_storage_buffers_per_shader_stage,
        max_compute_workgroup_storage_size: limits.max_compute_workgroup_storage_size,
        max_compute_invocations_per_workgroup: limits.max_compute_invocations_per_workgroup,
        subgroup_sizes: adapter
            .features()
            .contains(wgpu::Features::SUBGROUP)
            .then_some((info.subgroup_min_size, info.subgroup_max_size)),
        unsupported: unsupported_reason(adapter),
    }
}

/// Every wgpu adapter of this machine (Vulkan, Metal, DX12), hardware first. Empty when there is none
/// (no driver, no Vulkan loader): never an error.
pub fn list_adapters() -> Vec<AdapterReport> {
    let instance = instance();
    sorted_adapters(&instance)
        .iter()
        .enumerate()
        .map(|(i, a)| report(i, a))
        .collect()
}

/// The device a [`WgpuBackend`](super::WgpuBackend) runs on.
pub(crate) struct Context {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub limits: wgpu::Limits,
    pub report: AdapterReport,
}

impl Context {
    /// Opens the device of the adapter `selection` picks: [`BackendError::NoAdapter`] when none is usable,
    /// [`BackendError::Driver`] when the device cannot be opened.
    pub fn new(selection: AdapterSelection) -> Result<Context, BackendError> {
        let instance = instance();
        let all = sorted_adapters(&instance);
        let found: Vec<String> = all
            .iter()
            .map(|a| {
                let i = a.get_info();
                format!("{} ({:?}, {:?})", i.name, i.backend, i.device_type)
            })
            .collect();
        let candidates: Vec<(usize, wgpu::Adapter)> = all
            .into_iter()
            .enumerate()
            .filter(|(_, a)| selection.kind == AdapterKind::Any || !is_software(&a.get_info()))
            .filter(|(_, a)| unsupported_reason(a).is_none())
            .collect();
        if candidates.is_empty() {
            let what = match selection.kind {
                AdapterKind::Any => "no usable wgpu adapter",
                AdapterKind::HardwareOnly => "no usable hardware wgpu adapter",
            };
            let why = if found.is_empty() {
                let hint = "is a driver and the Vulkan loader installed?";
                format!("{what}: wgpu found no Vulkan, Metal or DX12 adapter ({hint})")
            } else {
                format!("{what} among: {}", found.join("; "))
            };
            return Err(BackendError::NoAdapter(why));
        }
        let pick = selection.index.unwrap_or(0) % candidates.len();
        let (index, adapter) = candidates
            .into_iter()
            .nth(pick)
            .expect("index reduced modulo the length");
        let report = report(index, &adapter);
        // Ask for everything the adapter offers: large storage bindings matter for GPT-2's 154 MB wte.
        let limits = adapter.limits();
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("ringtrain"),
            required_features: adapter.features() & wgpu::Features::SUBGROUP,
            required_limits: limits.clone(),
            experimental_features: wgpu::ExperimentalFeatures::disabled(),
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        }))
        .map_err(|e| BackendError::Driver(format!("cannot open a device on {}: {e}", report.name)))?;
        Ok(Context {
            device,
            queue,
            limits,
            report,
        })
    }
}
