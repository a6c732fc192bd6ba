//! Backends erased: [`DynApi`], an [`Api`] whose every handle holds some
//! backend's handle behind a trait object, so the code above it (gdr-core's
//! engine) is written once, not generic, and takes its backend at run time
//! (wgpu-hal's `dynamic` module is the model).
//!
//! Make one with [`DynDriver::new`]; everything made through it is of that
//! backend. Where a call takes another handle (an event to record, a
//! reservation and physical memory to map, a peer context), that handle
//! must be of the same backend: one of another is refused with
//! [`CudaError::InvalidArgument`] naming what was foreign, never a panic.
//!
//! ```
//! # #[cfg(feature = "mock")] {
//! use hal_cuda::dynamic::DynDriver;
//! use hal_cuda::mock::{MockApi, MockDriver};
//! use hal_cuda::Driver as _;
//!
//! let mut mock = MockDriver::new();
//! mock.expect_device_count().returning(|| Ok(2));
//! let driver = DynDriver::new::<MockApi>(mock);
//! assert_eq!(driver.device_count().unwrap(), 2);
//! # }
//! ```

use std::any::Any;
use std::ffi::c_void;
use std::fmt::{self, Debug};
use std::os::fd::OwnedFd;

use crate::api::{
    Api, Context, DeviceMemory, Driver, Event, HostRegistration, IpcMapping, PhysicalMemory,
    PinnedHostMemory, Stream, VirtualMapping, VirtualReservation,
};
use crate::error::{CudaError, Result};
use crate::types::{
    DeviceAttributes, FlushScope, HostRegisterFlags, IpcMemHandle, PointerAttributes,
};

/// The erased backend: its handles are the `Dyn*` types of this module.
#[derive(Debug)]
pub struct DynApi;

impl Api for DynApi {
    type Driver = DynDriver;
    type Context = DynContext;
    type Stream = DynStream;
    type Event = DynEvent;
    type DeviceMemory = DynDeviceMemory;
    type PinnedHostMemory = DynPinnedHostMemory;
    type HostRegistration = DynHostRegistration;
    type IpcMapping = DynIpcMapping;
    type VirtualReservation = DynVirtualReservation;
    type PhysicalMemory = DynPhysicalMemory;
    type VirtualMapping = DynVirtualMapping;
}

/// Implements `$role` for an erased handle: each method listed forwards to
/// the backend's handle behind `self.$field`; the methods after the list
/// (unsafe ones, those that consume the handle) are written out. Led by
/// `trait $dyn_trait { .. }`, it also declares the object-safe twin: the
/// listed methods, then the items in the braces.
macro_rules! forward {
    ($(#[$doc:meta])* trait $dyn_trait:ident { $($extra:tt)* }
    impl $role:path, for $handle:ident, via $field:tt {
        $(fn $name:ident(&self $(, $arg:ident: $ty:ty)* $(,)?) $(-> $ret:ty)?;)*
    } $($rest:tt)*) => {
        $(#[$doc])*
        trait $dyn_trait: Send + Sync + Debug {
            $(fn $name(&self $(, $arg: $ty)*) $(-> $ret)?;)*
            $($extra)*
        }

        forward!(impl $role, for $handle, via $field {
            $(fn $name(&self $(, $arg: $ty)*) $(-> $ret)?;)*
        } $($rest)*);
    };
    (impl $role:path, for $handle:ident, via $field:tt {
        $(fn $name:ident(&self $(, $arg:ident: $ty:ty)* $(,)?) $(-> $ret:ty)?;)*
    } $($rest:tt)*) => {
        impl $role for $handle {
            $(fn $name(&self $(, $arg: $ty)*) $(-> $ret)? {
                self.$field.$name($($arg),*)
            })*
            $($rest)*
        }
    };
}

/// `handle` as the concrete `T`, or the error for a foreign handle.
fn downcast<'a, T: 'static>(
    handle: &'a dyn Any,
    operation: &'static str,
    what: &'static str,
) -> Result<&'a T> {
    handle.downcast_ref::<T>().ok_or_else(|| {
        CudaError::invalid(
            operation,
            format!("the {what} is of another CUDA backend than the call's"),
        )
    })
}

/// Declares the handle type `$dyn` (a box of `$trait`) and the wrapper
/// `$of<A>` that holds backend `A`'s handle `$assoc`.
macro_rules! erased {
    ($(#[$doc:meta])* $dyn:ident, $trait:ident, $of:ident, $assoc:ident) => {
        $(#[$doc])*
        pub struct $dyn(Box<dyn $trait>);

        impl Debug for $dyn {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }

        /// Backend `A`'s handle, erased.
        struct $of<A: Api>(A::$assoc);

        impl<A: Api> Debug for $of<A> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }
    };
}

erased!(
    /// A driver of any backend ([`Driver`]).
    DynDriver, DriverDyn, DriverOf, Driver
);
erased!(
    /// A device context of any backend ([`Context`]).
    DynContext, ContextDyn, ContextOf, Context
);
erased!(
    /// A stream of any backend ([`Stream`]).
    DynStream, StreamDyn, StreamOf, Stream
);
erased!(
    /// An event of any backend ([`Event`]).
    DynEvent, EventDyn, EventOf, Event
);
erased!(
    /// Device memory of any backend ([`DeviceMemory`]).
    DynDeviceMemory, DeviceMemoryDyn, DeviceMemoryOf, DeviceMemory
);
erased!(
    /// Pinned host memory of any backend ([`PinnedHostMemory`]).
    DynPinnedHostMemory, PinnedDyn, PinnedOf, PinnedHostMemory
);
erased!(
    /// A host registration of any backend ([`HostRegistration`]).
    DynHostRegistration, HostRegistrationDyn, HostRegistrationOf, HostRegistration
);
erased!(
    /// An IPC mapping of any backend ([`IpcMapping`]).
    DynIpcMapping, IpcMappingDyn, IpcMappingOf, IpcMapping
);
erased!(
    /// A virtual address reservation of any backend ([`VirtualReservation`]).
    DynVirtualReservation, ReservationDyn, ReservationOf, VirtualReservation
);
erased!(
    /// Physical memory of any backend ([`PhysicalMemory`]).
    DynPhysicalMemory, PhysicalDyn, PhysicalOf, PhysicalMemory
);
erased!(
    /// A mapping of any backend ([`VirtualMapping`]).
    DynVirtualMapping, MappingDyn, MappingOf, VirtualMapping
);

impl DynDriver {
    /// Backend `A`'s `driver`, erased: what it makes is of `A`.
    pub fn new<A: Api>(driver: A::Driver) -> Self {
        Self(Box::new(DriverOf::<A>(driver)))
    }
}

// ---- Driver

trait DriverDyn: Send + Sync + Debug {
    fn backend_name(&self) -> &'static str;
    fn device_count(&self) -> Result<u32>;
    fn device_attributes(&self, ordinal: u32) -> Result<DeviceAttributes>;
    fn context(&self, ordinal: u32) -> Result<DynContext>;
    fn process_token(&self) -> u64;
    fn host_token(&self) -> Option<[u8; 16]>;
}

impl<A: Api> DriverDyn for DriverOf<A> {
    fn backend_name(&self) -> &'static str {
        self.0.backend_name()
    }
    fn device_count(&self) -> Result<u32> {
        self.0.device_count()
    }
    fn device_attributes(&self, ordinal: u32) -> Result<DeviceAttributes> {
        self.0.device_attributes(ordinal)
    }
    fn context(&self, ordinal: u32) -> Result<DynContext> {
        Ok(DynContext(Box::new(ContextOf::<A>(
            self.0.context(ordinal)?,
        ))))
    }
    fn process_token(&self) -> u64 {
        self.0.process_token()
    }
    fn host_token(&self) -> Option<[u8; 16]> {
        self.0.host_token()
    }
}

forward!(impl Driver<DynApi>, for DynDriver, via 0 {
    fn backend_name(&self) -> &'static str;
    fn device_count(&self) -> Result<u32>;
    fn device_attributes(&self, ordinal: u32) -> Result<DeviceAttributes>;
    fn context(&self, ordinal: u32) -> Result<DynContext>;
    fn process_token(&self) -> u64;
    fn host_token(&self) -> Option<[u8; 16]>;
});

// ---- Context

fn stream<A: Api>(stream: A::Stream) -> DynStream {
    DynStream(Box::new(StreamOf::<A>(stream)))
}

fn physical<A: Api>(memory: A::PhysicalMemory) -> DynPhysicalMemory {
    DynPhysicalMemory(Box::new(PhysicalOf::<A>(memory)))
}

impl<A: Api> ContextDyn for ContextOf<A> {
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn ordinal(&self) -> u32 {
        self.0.ordinal()
    }
    fn alloc(&self, len: usize) -> Result<DynDeviceMemory> {
        Ok(DynDeviceMemory(Box::new(DeviceMemoryOf::<A>(
            self.0.alloc(len)?,
        ))))
    }
    fn alloc_pinned(&self, len: usize) -> Result<DynPinnedHostMemory> {
        Ok(DynPinnedHostMemory(Box::new(PinnedOf::<A>(
            self.0.alloc_pinned(len)?,
        ))))
    }
    unsafe fn register_host(
        &self,
        ptr: *mut u8,
        len: usize,
        flags: HostRegisterFlags,
    ) -> Result<DynHostRegistration> {
        // SAFETY: forwarded from our caller's contract.
        let registration = unsafe { self.0.register_host(ptr, len, flags) }?;
        Ok(DynHostRegistration(Box::new(HostRegistrationOf::<A>(
            registration,
        ))))
    }
    fn create_stream(&self) -> Result<DynStream> {
        Ok(stream::<A>(self.0.create_stream()?))
    }
    unsafe fn borrow_stream(&self, raw: *mut c_void) -> Result<DynStream> {
        // SAFETY: forwarded from our caller's contract.
        Ok(stream::<A>(unsafe { self.0.borrow_stream(raw) }?))
    }
    fn create_event(&self) -> Result<DynEvent> {
        Ok(DynEvent(Box::new(EventOf::<A>(self.0.create_event()?))))
    }
    fn pointer_attributes(&self, addr: u64) -> Result<PointerAttributes> {
        self.0.pointer_attributes(addr)
    }
    fn export_dmabuf(&self, addr: u64, len: usize) -> Result<OwnedFd> {
        self.0.export_dmabuf(addr, len)
    }
    fn ipc_export(&self, addr: u64) -> Result<IpcMemHandle> {
        self.0.ipc_export(addr)
    }
    fn ipc_open(&self, handle: &IpcMemHandle) -> Result<DynIpcMapping> {
        Ok(DynIpcMapping(Box::new(IpcMappingOf::<A>(
            self.0.ipc_open(handle)?,
        ))))
    }
    fn enable_peer_access(&self, peer: &DynContext) -> Result<bool> {
        let peer: &ContextOf<A> =
            downcast(peer.0.as_any(), "cuCtxEnablePeerAccess", "peer context")?;
        self.0.enable_peer_access(&peer.0)
    }
    fn flush_gpu_direct_rdma_writes(&self, scope: FlushScope) -> Result<()> {
        self.0.flush_gpu_direct_rdma_writes(scope)
    }
    fn synchronize(&self) -> Result<()> {
        self.0.synchronize()
    }
    fn vmm_granularity(&self) -> Result<usize> {
        self.0.vmm_granularity()
    }
    fn reserve_address_range(&self, len: usize) -> Result<DynVirtualReservation> {
        Ok(DynVirtualReservation(Box::new(ReservationOf::<A>(
            self.0.reserve_address_range(len)?,
        ))))
    }
    fn create_physical(&self, len: usize) -> Result<DynPhysicalMemory> {
        Ok(physical::<A>(self.0.create_physical(len)?))
    }
    fn create_physical_with(&self, len: usize, gpu_direct_rdma: bool) -> Result<DynPhysicalMemory> {
        Ok(physical::<A>(
            self.0.create_physical_with(len, gpu_direct_rdma)?,
        ))
    }
    fn address_range(&self, addr: u64) -> Result<(u64, u64)> {
        self.0.address_range(addr)
    }
    fn map(
        &self,
        reservation: &DynVirtualReservation,
        offset: usize,
        physical: &DynPhysicalMemory,
    ) -> Result<DynVirtualMapping> {
        const OP: &str = "cuMemMap";
        let reservation: &ReservationOf<A> =
            downcast(reservation.0.as_any(), OP, "address reservation")?;
        let physical: &PhysicalOf<A> = downcast(physical.0.as_any(), OP, "physical memory")?;
        let mapping = self.0.map(&reservation.0, offset, &physical.0)?;
        Ok(DynVirtualMapping(Box::new(MappingOf::<A>(mapping))))
    }
}

forward!(trait ContextDyn {
    fn as_any(&self) -> &dyn Any;
    /// # Safety
    /// As [`Context::register_host`].
    unsafe fn register_host(
        &self,
        ptr: *mut u8,
        len: usize,
        flags: HostRegisterFlags,
    ) -> Result<DynHostRegistration>;
    /// # Safety
    /// As [`Context::borrow_stream`].
    unsafe fn borrow_stream(&self, raw: *mut c_void) -> Result<DynStream>;
}
impl Context<DynApi>, for DynContext, via 0 {
    fn ordinal(&self) -> u32;
    fn alloc(&self, len: usize) -> Result<DynDeviceMemory>;
    fn alloc_pinned(&self, len: usize) -> Result<DynPinnedHostMemory>;
    fn create_stream(&self) -> Result<DynStream>;
    fn create_event(&self) -> Result<DynEvent>;
    fn pointer_attributes(&self, addr: u64) -> Result<PointerAttributes>;
    fn export_dmabuf(&self, addr: u64, len: usize) -> Result<OwnedFd>;
    fn ipc_export(&self, addr: u64) -> Result<IpcMemHandle>;
    fn ipc_open(&self, handle: &IpcMemHandle) -> Result<DynIpcMapping>;
    fn enable_peer_access(&self, peer: &DynContext) -> Result<bool>;
    fn flush_gpu_direct_rdma_writes(&self, scope: FlushScope) -> Result<()>;
    fn synchronize(&self) -> Result<()>;
    fn vmm_granularity(&self) -> Result<usize>;
    fn reserve_address_range(&self, len: usize) -> Result<DynVirtualReservation>;
    fn create_physical(&self, len: usize) -> Result<DynPhysicalMemory>;
    fn create_physical_with(&self, len: usize, gpu_direct_rdma: bool) -> Result<DynPhysicalMemory>;
    fn address_range(&self, addr: u64) -> Result<(u64, u64)>;
    fn map(
        &self,
        reservation: &DynVirtualReservation,
        offset: usize,
        physical: &DynPhysicalMemory,
    ) -> Result<DynVirtualMapping>;
}
    unsafe fn register_host(
        &self,
        ptr: *mut u8,
        len: usize,
        flags: HostRegisterFlags,
    ) -> Result<DynHostRegistration> {
        // SAFETY: forwarded from our caller's contract.
        unsafe { self.0.register_host(ptr, len, flags) }
    }
    unsafe fn borrow_stream(&self, raw: *mut c_void) -> Result<DynStream> {
        // SAFETY: forwarded from our caller's contract.
        unsafe { self.0.borrow_stream(raw) }
    });

// ---- Stream and event

impl<A: Api> StreamDyn for StreamOf<A> {
    unsafe fn copy_host_to_device(&self, dst: u64, src: *const u8, len: usize) -> Result<()> {
        // SAFETY: forwarded from our caller's contract.
        unsafe { self.0.copy_host_to_device(dst, src, len) }
    }
    unsafe fn copy_device_to_host(&self, dst: *mut u8, src: u64, len: usize) -> Result<()> {
        // SAFETY: forwarded from our caller's contract.
        unsafe { self.0.copy_device_to_host(dst, src, len) }
    }
    unsafe fn copy_device_to_device(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        // SAFETY: forwarded from our caller's contract.
        unsafe { self.0.copy_device_to_device(dst, src, len) }
    }
    unsafe fn memset(&self, dst: u64, value: u8, len: usize) -> Result<()> {
        // SAFETY: forwarded from our caller's contract.
        unsafe { self.0.memset(dst, value, len) }
    }
    fn record(&self, event: &DynEvent) -> Result<()> {
        let event: &EventOf<A> = downcast(event.0.as_any(), "cuEventRecord", "event")?;
        self.0.record(&event.0)
    }
    fn wait(&self, event: &DynEvent) -> Result<()> {
        let event: &EventOf<A> = downcast(event.0.as_any(), "cuStreamWaitEvent", "event")?;
        self.0.wait(&event.0)
    }
    unsafe fn wait_value32(&self, addr: u64, value: u32) -> Result<()> {
        // SAFETY: forwarded from our caller's contract.
        unsafe { self.0.wait_value32(addr, value) }
    }
    unsafe fn write_value32(&self, addr: u64, value: u32) -> Result<()> {
        // SAFETY: forwarded from our caller's contract.
        unsafe { self.0.write_value32(addr, value) }
    }
    fn synchronize(&self) -> Result<()> {
        self.0.synchronize()
    }
    fn raw(&self) -> *mut c_void {
        self.0.raw()
    }
}

forward!(trait StreamDyn {
    /// # Safety
    /// As [`Stream::copy_host_to_device`].
    unsafe fn copy_host_to_device(&self, dst: u64, src: *const u8, len: usize) -> Result<()>;
    /// # Safety
    /// As [`Stream::copy_device_to_host`].
    unsafe fn copy_device_to_host(&self, dst: *mut u8, src: u64, len: usize) -> Result<()>;
    /// # Safety
    /// As [`Stream::copy_device_to_device`].
    unsafe fn copy_device_to_device(&self, dst: u64, src: u64, len: usize) -> Result<()>;
    /// # Safety
    /// As [`Stream::memset`].
    unsafe fn memset(&self, dst: u64, value: u8, len: usize) -> Result<()>;
    /// # Safety
    /// As [`Stream::wait_value32`].
    unsafe fn wait_value32(&self, addr: u64, value: u32) -> Result<()>;
    /// # Safety
    /// As [`Stream::write_value32`].
    unsafe fn write_value32(&self, addr: u64, value: u32) -> Result<()>;
}
impl Stream<DynApi>, for DynStream, via 0 {
    fn record(&self, event: &DynEvent) -> Result<()>;
    fn wait(&self, event: &DynEvent) -> Result<()>;
    fn synchronize(&self) -> Result<()>;
    fn raw(&self) -> *mut c_void;
}
    unsafe fn copy_host_to_device(&self, dst: u64, src: *const u8, len: usize) -> Result<()> {
        // SAFETY: forwarded from our caller's contract.
        unsafe { self.0.copy_host_to_device(dst, src, len) }
    }
    unsafe fn copy_device_to_host(&self, dst: *mut u8, src: u64, len: usize) -> Result<()> {
        // SAFETY: forwarded from our caller's contract.
        unsafe { self.0.copy_device_to_host(dst, src, len) }
    }
    unsafe fn copy_device_to_device(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        // SAFETY: forwarded from our caller's contract.
        unsafe { self.0.copy_device_to_device(dst, src, len) }
    }
    unsafe fn memset(&self, dst: u64, value: u8, len: usize) -> Result<()> {
        // SAFETY: forwarded from our caller's contract.
        unsafe { self.0.memset(dst, value, len) }
    }
    unsafe fn wait_value32(&self, addr: u64, value: u32) -> Result<()> {
        // SAFETY: forwarded from our caller's contract.
        unsafe { self.0.wait_value32(addr, value) }
    }
    unsafe fn write_value32(&self, addr: u64, value: u32) -> Result<()> {
        // SAFETY: forwarded from our caller's contract.
        unsafe { self.0.write_value32(addr, value) }
    });

impl<A: Api> EventDyn for EventOf<A> {
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn is_complete(&self) -> Result<bool> {
        self.0.is_complete()
    }
    fn synchronize(&self) -> Result<()> {
        self.0.synchronize()
    }
}

forward!(trait EventDyn {
    fn as_any(&self) -> &dyn Any;
}
impl Event, for DynEvent, via 0 {
    fn is_complete(&self) -> Result<bool>;
    fn synchronize(&self) -> Result<()>;
});

// ---- Memory

/// Implements a memory role trait for its erased handle and its wrapper:
/// each method forwards.
macro_rules! memory {
    ($role:ident, $trait:ident, $dyn:ident, $of:ident { $($(#[$attr:meta])* fn $name:ident(&self) -> $ty:ty;)* }) => {
        trait $trait: Send + Sync + Debug {
            // Only reservations and physical memory are passed to another
            // call (`map`) and downcast.
            #[allow(dead_code)]
            fn as_any(&self) -> &dyn Any;
            $($(#[$attr])* fn $name(&self) -> $ty;)*
        }

        impl<A: Api> $trait for $of<A> {
            fn as_any(&self) -> &dyn Any {
                self
            }
            $(fn $name(&self) -> $ty {
                self.0.$name()
            })*
        }

        impl $role for $dyn {
            $(fn $name(&self) -> $ty {
                self.0.$name()
            })*
        }
    };
}

memory!(DeviceMemory, DeviceMemoryDyn, DynDeviceMemory, DeviceMemoryOf {
    fn device_ptr(&self) -> u64;
    fn len(&self) -> usize;
});
memory!(PinnedHostMemory, PinnedDyn, DynPinnedHostMemory, PinnedOf {
    fn as_ptr(&self) -> *mut u8;
    fn len(&self) -> usize;
});
memory!(HostRegistration, HostRegistrationDyn, DynHostRegistration, HostRegistrationOf {
    fn as_ptr(&self) -> *mut u8;
    fn len(&self) -> usize;
});
memory!(IpcMapping, IpcMappingDyn, DynIpcMapping, IpcMappingOf {
    fn device_ptr(&self) -> u64;
    fn len(&self) -> usize;
});
memory!(VirtualReservation, ReservationDyn, DynVirtualReservation, ReservationOf {
    fn base(&self) -> u64;
    fn len(&self) -> usize;
});
memory!(PhysicalMemory, PhysicalDyn, DynPhysicalMemory, PhysicalOf {
    fn len(&self) -> usize;
    fn gpu_direct_rdma_capable(&self) -> bool;
});
memory!(VirtualMapping, MappingDyn, DynVirtualMapping, MappingOf {
    fn device_ptr(&self) -> u64;
    fn len(&self) -> usize;
});
