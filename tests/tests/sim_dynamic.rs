//! The erased backends (`hal_verbs::dynamic`, `hal_cuda::dynamic`) over the
//! simulator: the verbs conformance suite passes through them unchanged,
//! the simulated GPU moves bytes through them, and a handle of another
//! backend is refused with a typed error, not a panic.

use hal_cuda::{Context as _, Driver as _, Event as _, Stream as _};
use hal_verbs::{AccessFlags, Context as _, ProtectionDomain as _, Provider as _, QpCaps};

/// The conformance suite on the default sim device, every handle erased.
mod conformance {
    fn backend(_test: &str) -> Option<gdr_tests::pair::DynSimBackend> {
        Some(gdr_tests::pair::DynSimBackend::new(
            "default",
            gdr_sim::DeviceConfig::default(),
        ))
    }

    gdr_tests::conformance_tests!(backend);
}

/// A sim node's provider, erased.
fn sim_provider() -> hal_verbs::dynamic::DynProvider {
    let fabric = gdr_sim::SimFabric::new();
    let verbs = gdr_tests::sim::add_node(&fabric, "a", gdr_sim::DeviceConfig::default());
    hal_verbs::dynamic::DynProvider::new::<gdr_sim::SimVerbsApi>(verbs)
}

/// A mock provider whose one device hands out CQs, erased.
fn mock_provider() -> hal_verbs::dynamic::DynProvider {
    use hal_verbs::mock::{
        MockApi, MockCompletionQueue, MockContext, MockProtectionDomain, MockProvider,
    };
    let mut provider = MockProvider::<MockApi>::new();
    provider.expect_open().returning(|_| {
        let mut context = MockContext::<MockApi>::new();
        context.expect_create_cq().returning(|_| {
            let mut cq = MockCompletionQueue::new();
            cq.expect_cq_id().return_const(7u64);
            Ok(cq)
        });
        context
            .expect_alloc_pd()
            .returning(|| Ok(MockProtectionDomain::<MockApi>::new()));
        Ok(context)
    });
    hal_verbs::dynamic::DynProvider::new::<MockApi>(provider)
}

/// A sim PD refuses a mock CQ (and a mock PD a sim CQ) with
/// `InvalidArgument` naming the foreign handle; the same CQ of its own
/// backend makes a QP.
#[test]
fn a_verbs_handle_of_another_backend_is_refused() {
    let sim = sim_provider().open("sim0").unwrap();
    let mock = mock_provider().open("mock0").unwrap();
    let (sim_pd, sim_cq) = (sim.alloc_pd().unwrap(), sim.create_cq(16).unwrap());
    let (mock_pd, mock_cq) = (mock.alloc_pd().unwrap(), mock.create_cq(16).unwrap());
    let caps = QpCaps::default();
    for error in [
        sim_pd.create_qp(&caps, &mock_cq, &mock_cq).unwrap_err(),
        sim_pd.create_qp(&caps, &sim_cq, &mock_cq).unwrap_err(),
        mock_pd.create_qp(&caps, &sim_cq, &sim_cq).unwrap_err(),
    ] {
        match &error {
            hal_verbs::VerbsError::InvalidArgument {
                operation, reason, ..
            } => {
                assert_eq!(*operation, "ibv_create_qp");
                assert!(reason.contains("completion queue"), "{reason}");
                assert!(reason.contains("another verbs backend"), "{reason}");
            }
            other => panic!("not InvalidArgument: {other:?}"),
        }
    }
    assert!(sim_pd.create_qp(&caps, &sim_cq, &sim_cq).is_ok());
    // Registration forwards too.
    let mut memory = vec![0u8; 4096];
    // SAFETY: `memory` outlives the registration, dropped first.
    let mr = unsafe { sim_pd.register(memory.as_mut_ptr() as u64, 4096, AccessFlags::transfer()) }
        .unwrap();
    assert_eq!(hal_verbs::MemoryRegion::len(&mr), 4096);
    hal_verbs::MemoryRegion::deregister(mr).unwrap();
}

/// The simulated GPU through the erased CUDA backend: bytes go to the
/// device and back through a stream, an event records and completes.
#[test]
fn the_simulated_gpu_moves_bytes_through_the_erased_backend() {
    let sim = gdr_sim::SimCuda::new(vec![gdr_sim::GpuConfig::default()], Default::default());
    let driver = hal_cuda::dynamic::DynDriver::new::<gdr_sim::SimCudaApi>(sim);
    assert_eq!(driver.device_count().unwrap(), 1);
    let context = driver.context(0).unwrap();
    let memory = context.alloc(4096).unwrap();
    let stream = context.create_stream().unwrap();
    let event = context.create_event().unwrap();
    let src: Vec<u8> = (0..4096).map(|i| (i % 251) as u8).collect();
    let mut back = vec![0u8; 4096];
    let device = hal_cuda::DeviceMemory::device_ptr(&memory);
    // SAFETY: both host buffers and the device memory outlive the stream's
    // work, which is synchronised below before they drop.
    unsafe {
        stream
            .copy_host_to_device(device, src.as_ptr(), 4096)
            .unwrap();
        stream
            .copy_device_to_host(back.as_mut_ptr(), device, 4096)
            .unwrap();
    }
    stream.record(&event).unwrap();
    event.synchronize().unwrap();
    assert!(event.is_complete().unwrap());
    assert_eq!(back, src);
}

/// A sim stream refuses a mock event (to record or wait on) with
/// `InvalidArgument` naming the foreign handle.
#[test]
fn a_cuda_handle_of_another_backend_is_refused() {
    use hal_cuda::mock::{MockApi, MockContext, MockDriver, MockEvent};
    let mut mock = MockDriver::<MockApi>::new();
    mock.expect_context().returning(|_| {
        let mut context = MockContext::<MockApi>::new();
        context
            .expect_create_event()
            .returning(|| Ok(MockEvent::new()));
        Ok(context)
    });
    let mock = hal_cuda::dynamic::DynDriver::new::<MockApi>(mock);
    let mock_event = mock.context(0).unwrap().create_event().unwrap();
    let sim = gdr_sim::SimCuda::new(vec![gdr_sim::GpuConfig::default()], Default::default());
    let sim = hal_cuda::dynamic::DynDriver::new::<gdr_sim::SimCudaApi>(sim);
    let stream = sim.context(0).unwrap().create_stream().unwrap();
    for (error, operation) in [
        (stream.record(&mock_event).unwrap_err(), "cuEventRecord"),
        (stream.wait(&mock_event).unwrap_err(), "cuStreamWaitEvent"),
    ] {
        match &error {
            hal_cuda::CudaError::InvalidArgument {
                operation: op,
                reason,
                ..
            } => {
                assert_eq!(*op, operation);
                assert!(reason.contains("another CUDA backend"), "{reason}");
            }
            other => panic!("not InvalidArgument: {other:?}"),
        }
    }
}

/// An erased provider gives back its backend's own provider, the same
/// node (it opens the node's devices), and nothing for another backend.
#[test]
fn an_erased_provider_downcasts_to_its_own_backend_only() {
    let fabric = gdr_sim::SimFabric::new();
    let node = gdr_tests::sim::add_node(&fabric, "a", gdr_sim::DeviceConfig::default());
    let erased = node.erased();
    let back = erased
        .downcast_ref::<gdr_sim::SimVerbsApi>()
        .expect("the sim's provider");
    assert_eq!(
        back.device_ipv4("sim0"),
        node.device_ipv4("sim0"),
        "the same node"
    );
    assert!(erased.downcast_ref::<hal_verbs::mock::MockApi>().is_none());
    assert!(
        mock_provider()
            .downcast_ref::<gdr_sim::SimVerbsApi>()
            .is_none()
    );
}
