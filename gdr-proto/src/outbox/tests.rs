use super::*;

const T: Duration = Duration::from_secs(1);

#[test]
fn messages_go_out_in_order() {
    let now = Instant::now();
    let mut o = Outbox::new(4);
    for i in 0..3u8 {
        o.push(vec![i], i, now, T).unwrap();
    }
    assert_eq!(o.len(), 3);
    let order: Vec<u8> = std::iter::from_fn(|| o.pop().map(|w| w.token)).collect();
    assert_eq!(order, [0, 1, 2]);
    assert!(o.is_empty());
}

#[test]
fn a_full_outbox_refuses_and_loses_nothing() {
    let now = Instant::now();
    let mut o = Outbox::new(2);
    o.push(vec![1], 1, now, T).unwrap();
    o.push(vec![2], 2, now, T).unwrap();
    assert_eq!(o.push(vec![3], 3, now, T), Err((OutboxFull { max: 2 }, 3)));
    assert_eq!(o.len(), 2, "what waited still waits");
    assert_eq!(o.pop().map(|w| w.bytes), Some(vec![1]));
    o.push(vec![3], 3, now, T).unwrap();
    assert_eq!(o.len(), 2);
}

#[test]
fn a_message_past_its_deadline_expires_oldest_first() {
    let now = Instant::now();
    let mut o = Outbox::new(4);
    o.push(vec![1], 1, now, T).unwrap();
    o.push(vec![2], 2, now, 3 * T).unwrap();
    o.push(vec![3], 3, now, T).unwrap();
    assert!(o.poll_expired(now + T / 2).is_none(), "none late yet");
    assert_eq!(o.poll_timeout(), Some(now + T));
    let late = o.poll_expired(now + T).expect("the oldest is late");
    assert_eq!((late.token, late.timeout), (1, T));
    // The next is live: the one behind it waits its turn.
    assert!(o.poll_expired(now + 2 * T).is_none());
    assert_eq!(o.pop().map(|w| w.token), Some(2));
    assert_eq!(o.poll_expired(now + 2 * T).map(|w| w.token), Some(3));
    assert_eq!(o.poll_timeout(), None);
}

#[test]
fn a_timeout_past_what_an_instant_holds_never_expires() {
    let now = Instant::now();
    let mut o = Outbox::new(1);
    o.push(vec![1], 1, now, Duration::MAX).unwrap();
    assert_eq!(o.poll_timeout(), None);
    assert!(o.poll_expired(now + Duration::from_secs(1 << 30)).is_none());
}
