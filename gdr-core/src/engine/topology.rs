//! Which NIC is nearest a GPU: PCIe distance read from sysfs.
