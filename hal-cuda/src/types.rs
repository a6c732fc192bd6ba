//! Plain data of the CUDA HAL. Numeric values match `cuda.h`.

use crate::error::CudaError;

/// The attributes of one GPU that decide how gdr can move its memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceAttributes {
    /// Device ordinal.
    pub ordinal: u32,
    /// Marketing name, e.g. `NVIDIA H200`.
    pub name: String,
    /// PCI bus id, `dddd:bb:dd.f` (lower case), to pair the GPU with the
    /// nearest NIC.
    pub pci_bus_id: String,
    /// Device memory in bytes.
    pub total_memory: u64,
    /// Compute capability (major, minor).
    pub compute_capability: (u32, u32),
    /// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`: memory can be exported as a
    /// dma-buf and registered with `ibv_reg_dmabuf_mr`.
    pub dma_buf_supported: bool,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED`.
    pub gpu_direct_rdma_supported: bool,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS`.
    pub flush_writes_options: FlushWritesOptions,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING`.
    pub writes_ordering: WritesOrdering,
    /// `CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED` (cuMemCreate).
    pub virtual_memory_management: bool,
}

impl DeviceAttributes {
    /// How a kernel on this device can see inbound GPUDirect RDMA writes in
    /// order: by the device's own ordering, after a flush, or not at all.
    pub fn writes_visibility(&self) -> WritesVisibility {
        if self.writes_ordering != WritesOrdering::None {
            WritesVisibility::Ordered
        } else if !self.flush_writes_options.is_empty() {
            WritesVisibility::FlushRequired(self.flush_writes_options)
        } else {
            WritesVisibility::Unsafe
        }
    }

    /// Whether inbound RDMA writes must be flushed
    /// (`cuFlushGPUDirectRDMAWrites`) before a kernel may read them:
    /// `Ok(false)` when the device orders them for its own kernels already,
    /// `Ok(true)` when it does not but offers that flush. A device with
    /// neither (or whose only flush is a stream memory operation, which this
    /// HAL does not issue) cannot safely consume GPUDirect writes at all:
    /// that is [`CudaError::NotSupported`], never "no flush needed".
    pub fn needs_flush_before_kernels(&self) -> Result<bool, CudaError> {
        match self.writes_visibility() {
            WritesVisibility::Ordered => Ok(false),
            WritesVisibility::FlushRequired(options)
                if options.contains(FlushWritesOptions::HOST) =>
            {
                Ok(true)
            }
            WritesVisibility::FlushRequired(options) => Err(CudaError::unsupported(
                "consuming GPUDirect RDMA writes",
                format!(
                    "device {} ({}) orders no inbound RDMA writes and offers only the flush \
                     options {options:?}, not cuFlushGPUDirectRDMAWrites",
                    self.ordinal, self.name
                ),
            )),
            WritesVisibility::Unsafe => Err(CudaError::unsupported(
                "consuming GPUDirect RDMA writes",
                format!(
                    "device {} ({}) neither orders inbound RDMA writes nor offers a flush: \
                     its kernels cannot safely read GPUDirect writes",
                    self.ordinal, self.name
                ),
            )),
        }
    }
}

/// How inbound GPUDirect RDMA writes become visible to a device's kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WritesVisibility {
    /// The device orders them (`WRITES_ORDERING` owner or all devices).
    Ordered,
    /// A flush is needed, with these options (never empty).
    FlushRequired(FlushWritesOptions),
    /// Neither ordering nor a flush: the device cannot safely consume
    /// GPUDirect writes.
    Unsafe,
}

bitflags::bitflags! {
    /// `CUflushGPUDirectRDMAWritesOptions`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct FlushWritesOptions: u32 {
        /// `cuFlushGPUDirectRDMAWrites` is available.
        const HOST = 1;
        /// A memory operation on a stream can flush (`cuStreamWriteValue` with
        /// the flush flag).
        const MEMOPS = 2;
    }
}

/// `CUGPUDirectRDMAWritesOrdering`: who sees inbound RDMA writes in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WritesOrdering {
    /// No ordering guaranteed: flush before consuming.
    None,
    /// The owning device's kernels see them in order (H100/H200: 100).
    Owner,
    /// Every device sees them in order.
    AllDevices,
}

impl WritesOrdering {
    /// From the native attribute value.
    pub fn from_native(value: i32) -> Self {
        match value {
            100 => Self::Owner,
            200 => Self::AllDevices,
            _ => Self::None,
        }
    }
}

/// The scope of a GPUDirect RDMA write flush (`CUflushGPUDirectRDMAWritesScope`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlushScope {
    /// Visible to the owning device (100).
    Owner,
    /// Visible to all devices (200).
    AllDevices,
}

/// What kind of memory an address is, as the driver sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryType {
    /// Ordinary pageable host memory, unknown to CUDA.
    PageableHost,
    /// Page-locked host memory (allocated pinned, or registered).
    PinnedHost,
    /// Device memory.
    Device,
    /// Managed (unified) memory: may migrate; never registered for GDR.
    Managed,
}

/// How an allocation was made, which decides what can be exported from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AllocationKind {
    /// `cuMemAlloc`: one contiguous allocation; IPC and dma-buf of any
    /// page-aligned range work.
    Legacy,
    /// `cuMemCreate` + `cuMemMap` (VMM): `cuMemGetAddressRange` returns one
    /// physical chunk only, and legacy IPC does not work.
    VirtualMemoryManagement,
    /// Not device memory, or not told.
    Other,
}

/// Pointer attributes of an address (`cuPointerGetAttributes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PointerAttributes {
    /// Host, pinned, device or managed.
    pub memory_type: MemoryType,
    /// The owning device, for device and managed memory.
    pub device_ordinal: Option<u32>,
    /// First address of the allocation holding it (`CU_POINTER_ATTRIBUTE_RANGE_START_ADDR`).
    pub allocation_base: u64,
    /// Size of that allocation (`CU_POINTER_ATTRIBUTE_RANGE_SIZE`).
    pub allocation_size: u64,
    /// `CU_POINTER_ATTRIBUTE_BUFFER_ID`: unique per allocation for the life
    /// of the process; a freed and re-allocated address gets a new one. The
    /// registration cache validates its entries with it. 0 for pageable host.
    pub buffer_id: u64,
    /// How the allocation was made.
    pub allocation_kind: AllocationKind,
    /// `CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE`.
    pub gpu_direct_rdma_capable: bool,
}

/// A CUDA IPC memory handle (`CUipcMemHandle`, 64 opaque bytes). Whoever
/// holds it can map the whole allocation it names: it is a capability, to be
/// sent only to trusted peers.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcMemHandle(pub [u8; 64]);

impl std::fmt::Debug for IpcMemHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Only a prefix: the full handle is a capability and should not land in logs.
        write!(f, "IpcMemHandle({:02x?}…)", &self.0[..4])
    }
}

bitflags::bitflags! {
    /// Flags of `cuMemHostRegister`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct HostRegisterFlags: u32 {
        /// Pinned for all contexts.
        const PORTABLE = 1;
        /// Mapped into the device address space.
        const DEVICEMAP = 2;
        /// The range is I/O memory (e.g. a BAR).
        const IOMEMORY = 4;
        /// The device only reads it.
        const READ_ONLY = 8;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attrs(ordering: WritesOrdering, options: FlushWritesOptions) -> DeviceAttributes {
        DeviceAttributes {
            ordinal: 0,
            name: "test".into(),
            pci_bus_id: "0000:00:00.0".into(),
            total_memory: 1 << 30,
            compute_capability: (9, 0),
            dma_buf_supported: true,
            gpu_direct_rdma_supported: true,
            flush_writes_options: options,
            writes_ordering: ordering,
            virtual_memory_management: true,
        }
    }

    #[test]
    fn flush_needed_only_without_owner_ordering() {
        // The H200 facts: ordering 100, options 1 -> kernels see writes in order.
        let h200 = attrs(WritesOrdering::from_native(100), FlushWritesOptions::HOST);
        assert_eq!(h200.writes_visibility(), WritesVisibility::Ordered);
        assert_eq!(h200.needs_flush_before_kernels(), Ok(false));
        let flush = attrs(WritesOrdering::from_native(0), FlushWritesOptions::HOST);
        assert_eq!(flush.needs_flush_before_kernels(), Ok(true));
    }

    #[test]
    fn a_device_with_neither_ordering_nor_flush_cannot_consume_writes() {
        let neither = attrs(WritesOrdering::None, FlushWritesOptions::empty());
        assert_eq!(neither.writes_visibility(), WritesVisibility::Unsafe);
        let e = neither.needs_flush_before_kernels().unwrap_err();
        assert!(matches!(e, CudaError::NotSupported { .. }), "{e}");
        assert!(e.to_string().contains("cannot safely"), "{e}");
        // Only a stream memop flush, which the HAL does not issue: refused too.
        let memops = attrs(WritesOrdering::None, FlushWritesOptions::MEMOPS);
        assert_eq!(
            memops.writes_visibility(),
            WritesVisibility::FlushRequired(FlushWritesOptions::MEMOPS)
        );
        assert!(memops.needs_flush_before_kernels().is_err());
    }

    #[test]
    fn ipc_handle_debug_does_not_leak_the_capability() {
        let h = IpcMemHandle([0xab; 64]);
        let text = format!("{h:?}");
        assert!(text.len() < 40, "{text}");
    }
}
