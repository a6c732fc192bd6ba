//! Gates in memory: a page of words, streams that write their value when
//! told (or fail, or never do), and the driver's loop, with no GPU.

use std::time::{Duration, Instant};

use proptest::prelude::*;

use super::*;

fn word_gate(book: &mut WordBook, deadline: Instant) -> GateWait {
    let (word, value) = book.take().expect("a free word");
    GateWait {
        signal: Signal::Word { word, value },
        deadline,
    }
}

fn word_of(gate: &GateWait) -> (usize, u32) {
    match gate.signal {
        Signal::Word { word, value } => (word, value),
        Signal::Event => unreachable!(),
    }
}

#[test]
fn a_gate_opens_when_its_stream_writes_its_value_and_frees_its_word() {
    let t0 = Instant::now();
    let mut book = WordBook::new(1);
    let mut page = [0u32; 1];
    let gate = word_gate(&mut book, t0 + Duration::from_secs(1));
    let (word, value) = word_of(&gate);
    let seen = |page: &[u32]| {
        if gate.word_reached(page[word]) {
            Seen::Reached
        } else {
            Seen::NotYet
        }
    };
    assert_eq!(gate.step(false, seen(&page), false, t0), Step::Wait);
    page[word] = value;
    assert_eq!(gate.step(false, seen(&page), false, t0), Step::Open);
    gate.retire(&mut book, true, page[word]);
    assert_eq!(book.take().map(|(w, _)| w), Some(word), "free again");
}

#[test]
fn a_cancel_wins_over_everything_even_the_stream_reaching_the_gate() {
    let t0 = Instant::now();
    let gate = GateWait {
        signal: Signal::Event,
        deadline: t0,
    };
    for seen in [Seen::Reached, Seen::NotYet, Seen::StreamFailed] {
        for gone in [false, true] {
            assert_eq!(
                gate.step(true, seen, gone, t0 + Duration::from_secs(1)),
                Step::End(GateEnd::Cancelled)
            );
        }
    }
}

#[test]
fn a_cancel_crossing_the_opening_stops_the_submission() {
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_secs(1);
    // Opened under the lock, then cancelled before the driver submitted.
    assert_eq!(at_open(true, t0, deadline), Err(GateEnd::Cancelled));
    assert_eq!(at_open(false, t0, deadline), Ok(Duration::from_secs(1)));
}

#[test]
fn the_deadline_ends_a_gate_not_reached_and_one_opened_too_late() {
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_millis(10);
    let gate = GateWait {
        signal: Signal::Event,
        deadline,
    };
    assert_eq!(gate.step(false, Seen::NotYet, false, t0), Step::Wait);
    assert_eq!(
        gate.step(false, Seen::NotYet, false, deadline),
        Step::End(GateEnd::TimedOut)
    );
    assert_eq!(
        gate.step(false, Seen::Reached, false, deadline),
        Step::Open,
        "reached at the deadline: it opens (the submission checks the time left)"
    );
    assert_eq!(at_open(false, deadline, deadline), Err(GateEnd::TimedOut));
}

#[test]
fn a_gone_peer_ends_a_gate_not_reached_and_a_failed_stream_ends_it_too() {
    let t0 = Instant::now();
    let gate = GateWait {
        signal: Signal::Event,
        deadline: t0 + Duration::from_secs(1),
    };
    assert_eq!(
        gate.step(false, Seen::NotYet, true, t0),
        Step::End(GateEnd::PeerGone)
    );
    assert_eq!(
        gate.step(false, Seen::StreamFailed, false, t0),
        Step::End(GateEnd::StreamFailed)
    );
}

#[test]
fn on_the_word_path_the_event_is_looked_at_every_64th_step_only() {
    let word = GateWait {
        signal: Signal::Word { word: 0, value: 1 },
        deadline: Instant::now(),
    };
    let looks: Vec<u64> = (0..200).filter(|&t| word.looks_at_event(t)).collect();
    assert_eq!(looks, [0, 64, 128, 192]);
    let event = GateWait {
        signal: Signal::Event,
        ..word
    };
    assert!((0..200).all(|t| event.looks_at_event(t)));
    assert!(!event.word_reached(u32::MAX), "the event path has no word");
}

#[test]
fn a_late_write_never_opens_a_later_gate() {
    let t0 = Instant::now();
    let mut book = WordBook::new(1);
    let mut page = [0u32; 1];
    let first = word_gate(&mut book, t0);
    let (word, v1) = word_of(&first);
    // It times out before its stream wrote: the word waits for the write.
    assert_eq!(
        first.step(false, Seen::NotYet, false, t0),
        Step::End(GateEnd::TimedOut)
    );
    first.retire(&mut book, false, page[word]);
    assert_eq!(book.take(), None, "the word is out until the late write");
    page[word] = v1;
    assert_eq!(book.collect(|w| page[w]), 1);
    let second = word_gate(&mut book, t0 + Duration::from_secs(1));
    let (again, v2) = word_of(&second);
    assert_eq!(again, word);
    assert!(v2 > v1);
    assert!(
        !second.word_reached(page[word]),
        "the first gate's write opened the second"
    );
}

#[test]
fn a_gate_opened_through_its_event_before_the_word_showed_waits_for_the_write() {
    let mut book = WordBook::new(1);
    let gate = word_gate(&mut book, Instant::now());
    let (word, value) = word_of(&gate);
    gate.retire(&mut book, true, value - 1);
    assert_eq!(book.take(), None);
    assert_eq!(book.collect(|_| value), 1);
    assert_eq!(book.take().map(|(w, _)| w), Some(word));
}

#[test]
fn a_word_awaiting_a_late_write_stays_out_until_it_lands() {
    let mut book = WordBook::new(1);
    let (word, first) = book.take().expect("one free");
    book.await_write(word, first);
    assert_eq!(book.take(), None, "handed out before the late write");
    assert_eq!(book.collect(|_| first - 1), 0, "not written yet");
    assert_eq!(book.take(), None);
    assert_eq!(book.collect(|_| first), 1);
    let (again, second) = book.take().expect("free once written");
    assert_eq!(again, word);
    assert!(second > first, "{second} after {first}: values must rise");
}

#[test]
fn values_rise_per_word_and_a_spent_word_is_retired() {
    let mut book = WordBook::new(2);
    let (a, v1) = book.take().unwrap();
    book.done(a, v1);
    let (b, v2) = book.take().unwrap();
    assert_eq!(b, a, "the word just freed comes back first");
    assert!(v2 > v1);
    book.done(b, u32::MAX);
    let (c, _) = book.take().unwrap();
    assert_ne!(c, a, "a word whose values are spent must not be reused");
    book.unused(c);
    assert_eq!(book.take().map(|(w, _)| w), Some(c));
}

#[derive(Debug, Clone)]
enum Op {
    /// A new gate, its stream writing after `delay` steps (never: `None`).
    Gate(Option<u8>),
    /// One step of every stream and of the driver.
    Step,
    /// Cancel the oldest waiting gate.
    Cancel,
}

proptest! {
    /// Gates over a page of 3 words, streams writing late or never,
    /// cancels and deadlines in any order: a gate opens only after its own
    /// stream wrote its own value, each gate ends once, and two live gates
    /// never share a word.
    #[test]
    fn a_gate_opens_only_on_its_own_streams_write(
        ops in prop::collection::vec(
            prop_oneof![
                2 => prop::option::of(0u8..6).prop_map(Op::Gate),
                5 => Just(Op::Step),
                1 => Just(Op::Cancel),
            ],
            0..80,
        )
    ) {
        let t0 = Instant::now();
        let mut book = WordBook::new(3);
        let mut page = [0u32; 3];
        // (gate, steps until its stream writes, its own write done, ended)
        struct Live { gate: GateWait, write_in: Option<u8>, written: bool, cancelled: bool }
        let mut waiting: Vec<Live> = Vec::new();
        // Streams of ended gates that will still write: (word, value, in).
        let mut late: Vec<(usize, u32, u8)> = Vec::new();
        let mut now = t0;
        for op in ops.into_iter().chain(std::iter::repeat_n(Op::Step, 20)) {
            match op {
                Op::Gate(write_in) => {
                    let Some((word, value)) = book.take() else { continue };
                    prop_assert!(
                        waiting.iter().all(|l| word_of(&l.gate).0 != word),
                        "two live gates share word {}", word
                    );
                    prop_assert!(
                        late.iter().all(|&(w, _, _)| w != word),
                        "a word handed out while a late write to it is pending"
                    );
                    waiting.push(Live {
                        gate: GateWait { signal: Signal::Word { word, value }, deadline: now + Duration::from_millis(8) },
                        write_in, written: false, cancelled: false,
                    });
                }
                Op::Cancel => {
                    if let Some(l) = waiting.first_mut() { l.cancelled = true; }
                }
                Op::Step => {
                    now += Duration::from_millis(1);
                    for l in &mut waiting {
                        if let Some(n) = l.write_in.as_mut() {
                            if *n == 0 {
                                let (w, v) = word_of(&l.gate);
                                page[w] = page[w].max(v);
                                l.written = true;
                                l.write_in = None;
                            } else {
                                *n -= 1;
                            }
                        }
                    }
                    for (w, v, n) in &mut late {
                        if *n == 0 { page[*w] = page[*w].max(*v); } else { *n -= 1; }
                    }
                    late.retain(|&(w, v, _)| page[w] < v);
                    book.collect(|w| page[w]);
                    let mut i = 0;
                    while i < waiting.len() {
                        let l = &waiting[i];
                        let (w, _) = word_of(&l.gate);
                        let seen = if l.gate.word_reached(page[w]) { Seen::Reached } else { Seen::NotYet };
                        match l.gate.step(l.cancelled, seen, false, now) {
                            Step::Wait => { i += 1; continue; }
                            Step::Open => {
                                prop_assert!(l.written, "a gate opened before its own stream wrote");
                            }
                            Step::End(_) => {}
                        }
                        let l = waiting.swap_remove(i);
                        let opened = matches!(l.gate.step(l.cancelled, seen, false, now), Step::Open);
                        l.gate.retire(&mut book, opened, page[w]);
                        if let (Some(n), false) = (l.write_in, l.written) {
                            let (w, v) = word_of(&l.gate);
                            late.push((w, v, n));
                        }
                    }
                }
            }
        }
    }
}
