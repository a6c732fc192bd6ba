//! A pending slot ends on every path: a panic in the registering thread after
//! the registrar returned (here: in code the cache runs to log the outcome)
//! must not leave the slot's waiters waiting forever.
//!
//! The panics are honest ones: the cache formats the registrar's error and
//! emits events to whatever `tracing` subscriber the application installed,
//! both user code that can panic. Each test runs a waiter inside the
//! registration in flight and requires it to come back within a deadline (a
//! hang is a failure, not a stuck test run).

use std::fmt::{self, Write as _};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

use super::*;

const DEADLINE: Duration = Duration::from_secs(10);

/// An error whose `Display` panics (a registrar's error type is user code).
#[derive(Debug)]
struct Unprintable;

impl fmt::Display for Unprintable {
    fn fmt(&self, _: &mut fmt::Formatter<'_>) -> fmt::Result {
        panic!("Display of the registrar's error panicked (deliberately)")
    }
}

impl std::error::Error for Unprintable {}

#[derive(Debug)]
struct Mr;

/// Its first call blocks until the gate opens, then answers `first`; later
/// calls succeed.
struct Gated {
    calls: AtomicUsize,
    first: fn() -> Result<Mr, Unprintable>,
    open: Mutex<bool>,
    opened: Condvar,
}

impl Gated {
    fn new(first: fn() -> Result<Mr, Unprintable>) -> Self {
        Self {
            calls: AtomicUsize::new(0),
            first,
            open: Mutex::new(false),
            opened: Condvar::new(),
        }
    }

    fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.opened.notify_all();
    }
}

impl Registrar for Gated {
    type Registration = Mr;
    type Error = Unprintable;
    fn register(&self, _: &Request) -> Result<Mr, Unprintable> {
        if self.calls.fetch_add(1, Ordering::SeqCst) > 0 {
            return Ok(Mr);
        }
        let mut open = self.open.lock().unwrap();
        while !*open {
            open = self.opened.wait(open).unwrap();
        }
        (self.first)()
    }
}

/// A subscriber that formats every field, as a logging subscriber does;
/// with `panic_on_events` it also panics on every event (a log sink that
/// failed).
struct Formatting {
    panic_on_events: bool,
}

struct Fields(String);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        let _ = write!(self.0, "{field}={value:?} ");
    }
}

impl Subscriber for Formatting {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, span: &Attributes<'_>) -> Id {
        span.record(&mut Fields(String::new()));
        Id::from_u64(1)
    }
    fn record(&self, _: &Id, values: &Record<'_>) {
        values.record(&mut Fields(String::new()));
    }
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        event.record(&mut Fields(String::new()));
        assert!(
            !self.panic_on_events,
            "the log sink failed (a deliberate panic)"
        );
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

type Cache = RegistrationCache<Gated>;

/// Registers 0..0x1000 on one thread (under `subscriber`, expecting it to
/// panic) while another waits inside it; `while_registering` runs once the
/// waiter waits. Returns the waiter's result, or fails when it does not
/// come back within the deadline.
fn waiter_outcome(
    first: fn() -> Result<Mr, Unprintable>,
    subscriber: Formatting,
    while_registering: impl FnOnce(&Cache),
) -> Result<CacheHandle<Mr>, CacheError<Unprintable>> {
    let cache = Arc::new(Cache::new(CacheConfig {
        shards: 1,
        read_replicas: 1,
        ..CacheConfig::default()
    }));
    let reg = Arc::new(Gated::new(first));
    let request = Request::host(1, 0, 0x1000);

    let registering = {
        let (cache, reg) = (Arc::clone(&cache), Arc::clone(&reg));
        thread::spawn(move || {
            tracing::subscriber::with_default(subscriber, || {
                catch_unwind(AssertUnwindSafe(|| {
                    drop(cache.get_or_register(&*reg, &request));
                }))
                .is_err()
            })
        })
    };
    let started = Instant::now();
    while reg.calls.load(Ordering::SeqCst) == 0 {
        assert!(
            started.elapsed() < DEADLINE,
            "the registrar was never called"
        );
        thread::sleep(Duration::from_millis(1));
    }
    let (tx, rx) = mpsc::channel();
    {
        let (cache, reg) = (Arc::clone(&cache), Arc::clone(&reg));
        // Detached: on a hang it stays blocked, and the test fails below.
        thread::spawn(move || {
            let _ = tx.send(cache.get_or_register(&*reg, &request));
        });
    }
    while cache.waiters(1) == 0 {
        assert!(started.elapsed() < DEADLINE, "the waiter never waited");
        thread::sleep(Duration::from_millis(1));
    }
    while_registering(&cache);
    reg.open();
    assert!(
        registering.join().unwrap(),
        "the registering thread did not panic: the test injects nothing"
    );
    rx.recv_timeout(DEADLINE)
        .expect("the waiter hangs: its pending slot was never finished")
}

/// The registrar fails with an error whose `Display` panics when the cache
/// logs it: the waiter still gets the failure (or retries), never hangs.
#[test]
fn a_panic_while_logging_a_failure_does_not_strand_the_waiters() {
    let outcome = waiter_outcome(
        || Err(Unprintable),
        Formatting {
            panic_on_events: false,
        },
        |_| {},
    );
    match outcome {
        Err(CacheError::Register { start, end, .. }) => assert_eq!((start, end), (0, 0x1000)),
        Ok(_) => {} // it retried after an abandoned slot
        Err(_) => panic!("the waiter got another error than the registrar's"),
    }
}

/// The registration succeeds over a range invalidated meanwhile, and the
/// event the cache emits about it panics: the waiter still gets the
/// registration (or retries), never hangs.
#[test]
fn a_panic_while_logging_a_success_does_not_strand_the_waiters() {
    let outcome = waiter_outcome(
        || Ok(Mr),
        Formatting {
            panic_on_events: true,
        },
        |cache| assert_eq!(cache.invalidate(0, 0x1000), 0),
    );
    let handle = outcome.unwrap_or_else(|_| panic!("the waiter failed"));
    assert_eq!((handle.start(), handle.end()), (0, 0x1000));
}
