//! The provider (device list) and an opened device (`ibv_context`).

use std::ffi::{CStr, c_int};
use std::fmt;
use std::sync::Arc;

use rdma_mummy_sys as sys;

use super::events::RdmaCompChannel;
use super::memory::RdmaPd;
use super::queue::RdmaCq;
use super::{LIBIBVERBS, RdmaApi, clear_errno, errno, errno_or_eio, ret_errno, verb_error};
use crate::api::{Context, Provider};
use crate::error::{Result, VerbsError};
use crate::types::{
    AsyncEvent, CqModerationCaps, DeviceAttributes, DeviceInfo, Gid, GidEntry, GidType, LinkLayer,
    Mtu, PortAttributes, PortState,
};

/// Entry point of the rdma-core backend.
///
/// [`RdmaProvider::load`] checks that libibverbs was loaded by the shim;
/// [`Provider::devices`] tells "no library", "no device" and "these devices"
/// apart whichever way rdma-core reports them.
#[derive(Debug, Clone)]
pub struct RdmaProvider {
    _private: (),
}

impl RdmaProvider {
    /// Checks that libibverbs is present and usable.
    ///
    /// Fails with [`VerbsError::LibraryUnavailable`] when `libibverbs.so.1`
    /// could not be loaded or lacks its entry points. That a library loads
    /// says nothing about devices: [`Provider::devices`] says that.
    pub fn load() -> Result<Self> {
        let name = c"libibverbs.so.1";
        // SAFETY: `name` is a NUL-terminated string; with RTLD_NOLOAD dlopen
        // only looks up an object already loaded (by the shim's constructor)
        // and runs no initialisers.
        let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
        if handle.is_null() {
            return Err(VerbsError::LibraryUnavailable {
                library: LIBIBVERBS,
                reason: load_failure_reason(name),
            });
        }
        // SAFETY: `handle` is a live handle from dlopen above; the symbol
        // name is NUL-terminated. We only compare the result with NULL.
        let entry = unsafe { libc::dlsym(handle, c"ibv_get_device_list".as_ptr()) };
        // SAFETY: balances the reference the NOLOAD dlopen above took; the
        // shim keeps its own reference, so the library stays loaded.
        unsafe { libc::dlclose(handle) };
        if entry.is_null() {
            return Err(VerbsError::LibraryUnavailable {
                library: LIBIBVERBS,
                reason: "the library that loaded has no ibv_get_device_list".into(),
            });
        }
        Ok(Self { _private: () })
    }
}

/// Why `dlopen(name)` fails, asked again so the loader says it in words.
pub(crate) fn load_failure_reason(name: &CStr) -> String {
    // SAFETY: `name` is NUL-terminated. A successful load here (the library
    // appeared after start-up) is closed again at once: the shim's function
    // pointers were resolved at start-up and stay unset either way.
    let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns NULL or a NUL-terminated message owned by
        // the loader, valid until the next dl* call on this thread; it is
        // copied out at once.
        let msg = unsafe { libc::dlerror() };
        if msg.is_null() {
            "dlopen failed".into()
        } else {
            // SAFETY: non-NULL, NUL-terminated, see above.
            unsafe { CStr::from_ptr(msg) }
                .to_string_lossy()
                .into_owned()
        }
    } else {
        // SAFETY: `handle` came from the dlopen above and is closed once.
        unsafe { libc::dlclose(handle) };
        "it was not loaded when the process started (installed later?)".into()
    }
}

/// `ibv_get_device_list`'s array, freed on drop.
struct DeviceList {
    list: *mut *mut sys::ibv_device,
    len: usize,
}

impl DeviceList {
    /// The device list, or why there is none.
    fn get() -> Result<Self> {
        // Initialised here: without a device rdma-core may return NULL and
        // leave it untouched.
        let mut num: c_int = 0;
        clear_errno();
        // SAFETY: `num` is a valid out-parameter; the list is freed in Drop.
        let list = unsafe { sys::ibv_get_device_list(&mut num) };
        if list.is_null() {
            let e = errno();
            return Err(match e {
                // The shim's stub: the symbol was never resolved.
                libc::EOPNOTSUPP => VerbsError::LibraryUnavailable {
                    library: LIBIBVERBS,
                    reason: "ibv_get_device_list is not loaded (EOPNOTSUPP from the shim)".into(),
                },
                // libibverbs without the kernel's RDMA subsystem.
                libc::ENOSYS | 0 => VerbsError::NoDevice {
                    detail: format!(
                        "ibv_get_device_list returned no list (errno {e}): no RDMA subsystem"
                    ),
                },
                e => verb_error("ibv_get_device_list", "-", e),
            });
        }
        let guard = Self {
            list,
            len: usize::try_from(num).unwrap_or(0),
        };
        if guard.len == 0 {
            return Err(VerbsError::NoDevice {
                detail: "ibv_get_device_list returned an empty list".into(),
            });
        }
        Ok(guard)
    }

    /// The devices with their names.
    fn iter(&self) -> impl Iterator<Item = (*mut sys::ibv_device, String)> + '_ {
        (0..self.len)
            .map(|i| {
                // SAFETY: `list` holds `len` entries (followed by NULL), alive
                // until Drop.
                unsafe { *self.list.add(i) }
            })
            .take_while(|dev| !dev.is_null())
            .map(|dev| {
                // SAFETY: `dev` is a device of the live list; the name is a
                // NUL-terminated string owned by it, copied out at once.
                let name = unsafe { sys::ibv_get_device_name(dev) };
                let name = if name.is_null() {
                    String::new()
                } else {
                    // SAFETY: non-NULL, NUL-terminated, see above.
                    unsafe { CStr::from_ptr(name) }
                        .to_string_lossy()
                        .into_owned()
                };
                (dev, name)
            })
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: `list` came from ibv_get_device_list and is freed once;
        // opened contexts keep their devices referenced on their own.
        unsafe { sys::ibv_free_device_list(self.list) };
    }
}

/// The PCI function behind RDMA device `name`, from sysfs (its `device`
/// link names the function); `None` for a software device such as rxe.
fn pci_bus_id(name: &str) -> Option<String> {
    let link = std::fs::read_link(format!("/sys/class/infiniband/{name}/device")).ok()?;
    let id = link.file_name()?.to_str()?.to_ascii_lowercase();
    crate::types::is_pci_bus_id(&id).then_some(id)
}

impl Provider<RdmaApi> for RdmaProvider {
    fn backend_name(&self) -> &'static str {
        "rdma-core"
    }

    fn devices(&self) -> Result<Vec<DeviceInfo>> {
        let list = DeviceList::get()?;
        let devices: Vec<DeviceInfo> = list
            .iter()
            .map(|(dev, name)| {
                // SAFETY: `dev` is a device of the live list.
                let guid = unsafe { sys::ibv_get_device_guid(dev) };
                DeviceInfo {
                    pci_bus_id: pci_bus_id(&name),
                    name,
                    node_guid: u64::from_be(guid),
                }
            })
            .collect();
        if devices.is_empty() {
            return Err(VerbsError::NoDevice {
                detail: "ibv_get_device_list listed no usable device".into(),
            });
        }
        Ok(devices)
    }

    #[tracing::instrument(level = "debug", skip(self))]
    fn open(&self, name: &str) -> Result<RdmaContext> {
        let list = DeviceList::get()?;
        let mut names = Vec::new();
        let mut found = None;
        for (dev, dev_name) in list.iter() {
            if dev_name == name {
                found = Some(dev);
                break;
            }
            names.push(dev_name);
        }
        let Some(dev) = found else {
            return Err(VerbsError::NoDevice {
                detail: format!("{name} is not among the devices {names:?}"),
            });
        };
        clear_errno();
        // SAFETY: `dev` is a device of the live list; the context holds its
        // own reference to the device after the list is freed.
        let ctx = unsafe { sys::ibv_open_device(dev) };
        if ctx.is_null() {
            return Err(verb_error("ibv_open_device", name, errno_or_eio()));
        }
        let mut inner = ContextInner {
            ctx,
            name: name.to_owned(),
            attrs: DeviceAttributes::default(),
        };
        // On failure `inner` is dropped, closing the device.
        inner.attrs = inner.query_device_raw()?;
        // SAFETY: `ctx` is open; `async_fd` is a plain int it owns.
        let async_fd = unsafe { (*ctx).async_fd };
        // Non-blocking, so `next_async_event` never waits: the caller waits
        // on the fd itself (epoll, mio, tokio).
        super::events::set_nonblocking(async_fd, "ibv_open_device", name)?;
        tracing::debug!(device = name, attrs = ?inner.attrs, "opened");
        Ok(RdmaContext {
            inner: Arc::new(inner),
        })
    }

    fn connection_manager(&self) -> Result<super::RdmaCm> {
        super::RdmaCm::load()
    }
}

/// The native context, closed when the last handle that needs it is gone.
pub(crate) struct ContextInner {
    ctx: *mut sys::ibv_context,
    name: String,
    attrs: DeviceAttributes,
}

// SAFETY: an `ibv_context` may be used from any thread; libibverbs and its
// providers serialise what needs it internally. The pointer is never
// reassigned and is closed only in Drop, when no other handle can use it.
unsafe impl Send for ContextInner {}
// SAFETY: see Send: every verb on a context is thread-safe in rdma-core.
unsafe impl Sync for ContextInner {}

impl ContextInner {
    /// The native context, valid as long as `self` lives.
    pub(crate) fn as_ptr(&self) -> *mut sys::ibv_context {
        self.ctx
    }

    /// The device's name, for errors and logs.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Attributes queried when the device was opened.
    pub(crate) fn attrs(&self) -> &DeviceAttributes {
        &self.attrs
    }

    fn query_device_raw(&self) -> Result<DeviceAttributes> {
        // SAFETY: ibv_device_attr is plain integers and arrays, for which
        // all-zero is a valid value.
        let mut attr: sys::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: `ctx` is open; `attr` is a valid out-parameter.
        let ret = unsafe { sys::ibv_query_device(self.ctx, &mut attr) };
        if ret != 0 {
            return Err(verb_error("ibv_query_device", &self.name, ret_errno(ret)));
        }
        // SAFETY: fw_ver is a fixed array written NUL-terminated by the
        // library; we zeroed it, so a NUL is there even if it was not.
        let fw = unsafe { CStr::from_ptr(attr.fw_ver.as_ptr()) };
        let count = |v: c_int| u32::try_from(v).unwrap_or(0);
        // SAFETY: `ctx` is open; `num_comp_vectors` is a plain int.
        let num_comp_vectors = count(unsafe { (*self.ctx).num_comp_vectors });
        Ok(DeviceAttributes {
            num_comp_vectors,
            cq_moderation: self.cq_moderation_caps(),
            fw_ver: fw.to_string_lossy().into_owned(),
            vendor_id: attr.vendor_id,
            vendor_part_id: attr.vendor_part_id,
            max_mr_size: attr.max_mr_size,
            max_qp: count(attr.max_qp),
            max_qp_wr: count(attr.max_qp_wr),
            max_sge: count(attr.max_sge),
            max_cq: count(attr.max_cq),
            max_cqe: count(attr.max_cqe),
            max_mr: count(attr.max_mr),
            max_qp_rd_atom: count(attr.max_qp_rd_atom),
            max_qp_init_rd_atom: count(attr.max_qp_init_rd_atom),
            phys_port_cnt: attr.phys_port_cnt,
        })
    }

    /// CQ moderation limits from `ibv_query_device_ex`; `None` where it
    /// fails or reports none (rxe reports zeros).
    fn cq_moderation_caps(&self) -> Option<CqModerationCaps> {
        // SAFETY: both structs are plain integers; all-zero is valid (and
        // the input's comp_mask must be 0).
        let input: sys::ibv_query_device_ex_input = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut attr: sys::ibv_device_attr_ex = unsafe { std::mem::zeroed() };
        // SAFETY: `ctx` is open; `input` and `attr` are valid for the call
        // (the wrapper passes attr's size; providers fill what they know).
        let ret = unsafe { sys::ibv_query_device_ex(self.ctx, &input, &mut attr) };
        let caps = attr.cq_mod_caps;
        (ret == 0 && caps.max_cq_count != 0 && caps.max_cq_period != 0).then_some(
            CqModerationCaps {
                max_cq_count: caps.max_cq_count,
                max_cq_period_us: caps.max_cq_period,
            },
        )
    }

    fn check_port(&self, operation: &'static str, port: u8) -> Result<()> {
        if port == 0 || port > self.attrs.phys_port_cnt {
            return Err(VerbsError::invalid(
                operation,
                format!(
                    "port {port} does not exist on {} (ports 1..={})",
                    self.name, self.attrs.phys_port_cnt
                ),
            ));
        }
        Ok(())
    }

    pub(crate) fn query_port_raw(&self, port: u8) -> Result<sys::ibv_port_attr> {
        self.check_port("ibv_query_port", port)?;
        // SAFETY: ibv_port_attr is plain integers; all-zero is valid.
        let mut attr: sys::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: `ctx` is open (its ops table is the provider's); `attr`
        // is a valid out-parameter of the size the inline wrapper passes.
        let ret = unsafe { sys::ibv_query_port(self.ctx, port, &mut attr) };
        if ret != 0 {
            return Err(verb_error("ibv_query_port", &self.name, ret_errno(ret)));
        }
        Ok(attr)
    }

    pub(crate) fn link_layer(&self, port: u8) -> Result<LinkLayer> {
        Ok(link_layer_from_native(
            self.query_port_raw(port)?.link_layer,
        ))
    }
}

impl Drop for ContextInner {
    fn drop(&mut self) {
        // SAFETY: `ctx` came from ibv_open_device and is closed once; every
        // child object holds an Arc to us, so none is left.
        let ret = unsafe { sys::ibv_close_device(self.ctx) };
        if ret != 0 {
            tracing::warn!(
                device = %self.name,
                errno = ret_errno(ret),
                "ibv_close_device failed; the context leaks"
            );
        }
    }
}

impl fmt::Debug for ContextInner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ContextInner")
            .field("name", &self.name)
            .field("ctx", &self.ctx)
            .finish()
    }
}

fn link_layer_from_native(value: u8) -> LinkLayer {
    match value {
        sys::IBV_LINK_LAYER_INFINIBAND => LinkLayer::InfiniBand,
        sys::IBV_LINK_LAYER_ETHERNET => LinkLayer::Ethernet,
        _ => LinkLayer::Unspecified,
    }
}

fn mtu_from_native(value: u32, device: &str) -> Mtu {
    Mtu::from_native(value).unwrap_or_else(|| {
        tracing::warn!(device, value, "unknown MTU code; assuming 256 bytes");
        Mtu::Mtu256
    })
}

fn gid_type_from_native(value: u32) -> Option<GidType> {
    match value {
        sys::IBV_GID_TYPE_IB => Some(GidType::Ib),
        sys::IBV_GID_TYPE_ROCE_V1 => Some(GidType::RoceV1),
        sys::IBV_GID_TYPE_ROCE_V2 => Some(GidType::RoceV2),
        _ => None,
    }
}

/// An opened RDMA device. Cloning shares it.
#[derive(Debug, Clone)]
pub struct RdmaContext {
    pub(crate) inner: Arc<ContextInner>,
}

impl RdmaContext {
    /// The GID table as [`Context::gid_table`] falls back to reading it
    /// where libibverbs predates `ibv_query_gid_table` (rdma-core 32): entry
    /// by entry with `ibv_query_gid`, the types from sysfs. Public so tests
    /// can check the two paths agree.
    pub fn gid_table_by_query_gid(&self, port: u8) -> Result<Vec<GidEntry>> {
        let pattr = self.inner.query_port_raw(port)?;
        let len = usize::try_from(pattr.gid_tbl_len).unwrap_or(0);
        self.gid_table_by_index(port, len, link_layer_from_native(pattr.link_layer))
    }

    fn gid_table_by_index(&self, port: u8, len: usize, link: LinkLayer) -> Result<Vec<GidEntry>> {
        let name = self.inner.name();
        let mut out = Vec::new();
        for index in 0..len {
            // SAFETY: ibv_gid is 16 bytes; all-zero is valid.
            let mut gid: sys::ibv_gid = unsafe { std::mem::zeroed() };
            let idx = c_int::try_from(index).unwrap_or(c_int::MAX);
            // SAFETY: `ctx` is open; `gid` is a valid out-parameter.
            let ret = unsafe { sys::ibv_query_gid(self.inner.as_ptr(), port, idx, &mut gid) };
            if ret != 0 {
                return Err(verb_error("ibv_query_gid", name, ret_errno(ret)));
            }
            // SAFETY: every bit pattern of the union is a valid `raw`.
            let gid = Gid(unsafe { gid.raw });
            if gid.is_zero() {
                continue;
            }
            let attrs = format!("/sys/class/infiniband/{name}/ports/{port}/gid_attrs");
            let kind = std::fs::read_to_string(format!("{attrs}/types/{index}")).ok();
            let gid_type = match (link, kind.as_deref().map(str::trim)) {
                (LinkLayer::InfiniBand, _) => GidType::Ib,
                (_, Some("RoCE v2")) => GidType::RoceV2,
                _ => GidType::RoceV1,
            };
            let netdev_ifindex = std::fs::read_to_string(format!("{attrs}/ndevs/{index}"))
                .ok()
                .and_then(|dev| std::ffi::CString::new(dev.trim()).ok())
                // SAFETY: a NUL-terminated interface name; 0 means unknown.
                .map(|dev| unsafe { libc::if_nametoindex(dev.as_ptr()) })
                .unwrap_or(0);
            out.push(GidEntry {
                index: u32::try_from(index).unwrap_or(u32::MAX),
                gid,
                gid_type,
                netdev_ifindex,
            });
        }
        Ok(out)
    }
}

impl Context<RdmaApi> for RdmaContext {
    fn name(&self) -> String {
        self.inner.name.clone()
    }

    fn query_device(&self) -> Result<DeviceAttributes> {
        self.inner.query_device_raw()
    }

    fn query_port(&self, port: u8) -> Result<PortAttributes> {
        let attr = self.inner.query_port_raw(port)?;
        let name = self.inner.name();
        Ok(PortAttributes {
            state: PortState::from_native(attr.state),
            max_mtu: mtu_from_native(attr.max_mtu, name),
            active_mtu: mtu_from_native(attr.active_mtu, name),
            lid: attr.lid,
            gid_table_len: u32::try_from(attr.gid_tbl_len).unwrap_or(0),
            link_layer: link_layer_from_native(attr.link_layer),
        })
    }

    #[tracing::instrument(level = "debug", skip(self), fields(device = %self.inner.name))]
    fn gid_table(&self, port: u8) -> Result<Vec<GidEntry>> {
        let pattr = self.inner.query_port_raw(port)?;
        let per_port = usize::try_from(pattr.gid_tbl_len).unwrap_or(0);
        // ibv_query_gid_table returns the valid entries of every port and
        // fails if they do not fit: room for the whole device.
        let ports = usize::from(self.inner.attrs.phys_port_cnt.max(1));
        let room = per_port.saturating_mul(ports).max(1);
        // SAFETY: ibv_gid_entry is plain integers; all-zero is valid.
        let zero: sys::ibv_gid_entry = unsafe { std::mem::zeroed() };
        let mut entries = vec![zero; room];
        // SAFETY: `ctx` is open; `entries` has room for `room` entries of
        // the size the inline wrapper passes.
        let n =
            unsafe { sys::ibv_query_gid_table(self.inner.as_ptr(), entries.as_mut_ptr(), room, 0) };
        if n < 0 {
            let e = i32::try_from(-n).unwrap_or(libc::EIO);
            if e == libc::EOPNOTSUPP {
                tracing::debug!("ibv_query_gid_table unavailable; reading GIDs one by one");
                let link = link_layer_from_native(pattr.link_layer);
                return self.gid_table_by_index(port, per_port, link);
            }
            return Err(verb_error("ibv_query_gid_table", self.inner.name(), e));
        }
        entries.truncate(usize::try_from(n).unwrap_or(0));
        Ok(entries
            .iter()
            .filter(|e| e.port_num == u32::from(port))
            .filter_map(|e| {
                // SAFETY: every bit pattern of the union is a valid `raw`.
                let gid = Gid(unsafe { e.gid.raw });
                let gid_type = gid_type_from_native(e.gid_type)?;
                (!gid.is_zero()).then_some(GidEntry {
                    index: e.gid_index,
                    gid,
                    gid_type,
                    netdev_ifindex: e.ndev_ifindex,
                })
            })
            .collect())
    }

    #[tracing::instrument(level = "debug", skip(self), fields(device = %self.inner.name))]
    fn alloc_pd(&self) -> Result<RdmaPd> {
        RdmaPd::alloc(&self.inner)
    }

    #[tracing::instrument(level = "debug", skip(self), fields(device = %self.inner.name))]
    fn create_cq(&self, depth: u32) -> Result<RdmaCq> {
        RdmaCq::create(&self.inner, depth, None)
    }

    #[tracing::instrument(level = "debug", skip(self), fields(device = %self.inner.name))]
    fn create_comp_channel(&self) -> Result<RdmaCompChannel> {
        RdmaCompChannel::create(&self.inner)
    }

    #[tracing::instrument(level = "debug", skip(self, channel), fields(device = %self.inner.name))]
    fn create_cq_on_channel(
        &self,
        depth: u32,
        channel: &RdmaCompChannel,
        comp_vector: u32,
    ) -> Result<RdmaCq> {
        RdmaCq::create(&self.inner, depth, Some((&channel.inner, comp_vector)))
    }

    fn async_fd(&self) -> std::os::fd::RawFd {
        // SAFETY: the context is open while `inner` lives; a plain int.
        unsafe { (*self.inner.as_ptr()).async_fd }
    }

    fn next_async_event(&self) -> Result<Option<AsyncEvent>> {
        super::events::next_async_event(&self.inner)
    }
}
