#!/usr/bin/env python3
# Planted bugs in gdr-proto's protocols (batches, a peer's connection, its receive order, peer copy, gates, the requester
# and the owner of the rendezvous, the pipeline, reconnection): each is
# applied alone, the module's tests run (or, for an entry that names one,
# the two-endpoint pair test of gdr-proto/tests/ that must catch it), and
# the file restored. Every one must be caught (the tests fail). Run from
# the repository root, after `cargo fmt` (the patterns are formatted code).
import re, subprocess, sys
PC='gdr-proto/src/peer_copy.rs'
RDV='gdr-proto/src/rendezvous.rs'
GATE='gdr-proto/src/gate.rs'
REQ='gdr-proto/src/rendezvous/requester.rs'
PIPE='gdr-proto/src/pipeline.rs'
REC='gdr-proto/src/reconnect.rs'
OUT='gdr-proto/src/outbox.rs'
BAT='gdr-proto/src/batches.rs'
CONN='gdr-proto/src/connection.rs'
RCV='gdr-proto/src/receives.rs'
# The pair tests (both ends of a protocol over an encoded link).
PRDV='pair_rendezvous'
PPC='pair_peer_copy'
PAIR='pair'
muts=[
 (BAT,"told with requests in flight after an error","            self.drop_queued(batch);\n            self.finish_if_done(batch);\n        } else if","            self.drop_queued(batch);\n            self.finish(batch);\n        } else if"),
 (BAT,"hold released at the grace","                continue;\n            }\n            record.ended = true;","                self.batches.remove(batch);\n                continue;\n            }\n            record.ended = true;"),
 (BAT,"the grace tells nothing","            if record.ended {","            if record.ended && false {"),
 (BAT,"a timed-out batch's queue pair not stopped","                self.stop(qp, cause.clone());\n",""),
 (BAT,"cancel tells at once","        self.drop_queued(batch);\n        self.finish_if_done(batch);\n    }\n\n    /// The earliest","        self.drop_queued(batch);\n        self.finish(batch);\n    }\n\n    /// The earliest"),
 (BAT,"a batch id given twice","        slot.generation += 1;","        slot.generation = 1;"),
 (BAT,"the tail of a post unsignaled","            let signal = r.since_signal >= r.signal_every || i + 1 == n;","            let signal = r.since_signal >= r.signal_every;"),
 (BAT,"an unreported tail left running","        if !tail_reported {","        if false {"),
 (BAT,"the deadline heap unbounded","            if self.deadlines.len() > 2 * self.batches.live + 64 {","            if false {"),
 (BAT,"a failed queue pair takes work","                Health::Ready | Health::Reconnecting(_) => None,\n                Health::Failing(e) | Health::Drained(e) => Some(Err(e.clone())),\n","                _ => None,\n"),
 (BAT,"a SEND credit kept after its completion","            if item.send && returned {","            if item.send && returned && false {"),
 (PC,"stop ignored by poll_window","if self.stop.is_some() || self.exhausted() || self.queued >= self.windows.in_flight","if self.exhausted() || self.queued >= self.windows.in_flight"),
 (PC,"one window too many","|| self.queued >= self.windows.in_flight {","|| self.queued > self.windows.in_flight {"),
 (PC,"drained with windows queued","self.queued == 0 && (self.stop.is_some() || self.exhausted())","(self.stop.is_some() || self.exhausted())"),
 (PC,"outcome twice","        self.ended = true;\n        Some(outcome)","        Some(outcome)"),
 (PC,"release of a live grant","Some(e) if e.peer == peer && e.revoked =>","Some(e) if e.peer == peer =>"),
 (PC,"release from another peer","Some(e) if e.peer == peer && e.revoked =>","Some(e) if e.revoked =>"),
 (PC,"release owed sent while in use","            if in_use(peer, grant) {","            if in_use(peer, grant) && false {"),
 (PC,"last stop wins","        self.stop.get_or_insert(why);","        self.stop = Some(why);"),
 (PC,"deadline off by one","if self.deadline.is_some_and(|at| now >= at)","if self.deadline.is_some_and(|at| now > at)"),
 (PC,"given up not recorded","            self.given_up.push_back(grant);","            let _ = grant;"),
 (PC,"bound never expires",".filter(|(_, e)| e.release_by.is_some_and(|at| now >= at))",".filter(|(_, e)| e.release_by.is_some_and(|at| now > at + Duration::from_secs(3600)))"),
 (GATE,"cancel loses to a reached stream","        if cancelled {\n            return Step::End(GateEnd::Cancelled);\n        }\n        match seen {\n            Seen::Reached => Step::Open,","        match seen {\n            Seen::Reached => Step::Open,\n            _ if cancelled => Step::End(GateEnd::Cancelled),"),
 (GATE,"gone peer ignored","            Seen::NotYet if peer_gone => Step::End(GateEnd::PeerGone),\n",""),
 (GATE,"deadline off by one","            Seen::NotYet if now >= self.deadline","            Seen::NotYet if now > self.deadline"),
 (GATE,"word freed before the late write","            if opened && word_now >= value {","            if true {"),
 (GATE,"spent word reused","        if self.last[word] < u32::MAX {\n            self.free.push(word);","        {\n            self.free.push(word);"),
 (GATE,"values do not rise","        Some((word, self.last[word] + 1))","        Some((word, self.last[word].max(1)))"),
 (GATE,"event looked at every step","            Signal::Word { .. } => tick.is_multiple_of(EVENT_EVERY),","            Signal::Word { .. } => true,"),
 (GATE,"cancel at open ignored","    if cancelled {\n        return Err(GateEnd::Cancelled);\n    }\n    let left","    let left"),
 (REQ,"a busy slot lent again","        if !fits || busy {","        if !fits {"),
 (REQ,"a credit past the request","                && offset.checked_add(len).is_some_and(|end| end <= a.len)","                && offset.checked_add(len).is_some()"),
 (REQ,"credits moved for a failed request","        if a.failure.is_some() {\n            return;\n        }\n        let fits","        let fits"),
 (REQ,"ends with slices in flight","                a.in_flight == 0\n                    && (a.failure","                (a.failure"),
 (REQ,"Ok with bytes missing","                None if a.done == a.len => Ok(()),\n                None => Err(AskFailure::Incomplete),","                None => Ok(()),"),
 (REQ,"cancel sent to a gone peer","                    if !self.gone {\n                        self.actions.push_back(RequesterAction::Cancel { id });\n                    }","                    self.actions.push_back(RequesterAction::Cancel { id });"),
 (REQ,"a failed reply ignored","            if status != status::OK {\n                a.failure.get_or_insert(AskFailure::Refused(status));\n            }",""),
 (PIPE,"a slice starts after a failure","        while self.failure.is_none() && self.next < self.len {","        while self.next < self.len {"),
 (PIPE,"copied out after a failure goes on the wire","            Stage::CopyingOut if self.failure.is_none() => {","            Stage::CopyingOut => {"),
 (PIPE,"slot never freed after the wire","        } else {\n            self.actions\n                .push_back(PipeAction::Free { slot: slice.slot });\n        }\n    }\n\n    /// It fails","        }\n    }\n\n    /// It fails"),
 (PIPE,"ends with slices in flight","        let over = self.slices.is_empty()\n            && self.actions.is_empty()","        let over = self.actions.is_empty()"),
 (PIPE,"outcome twice","        if self.ended || !over {","        if !over {"),
 (PIPE,"deadline ignored","        if now >= self.deadline {\n            self.fail(PipeFailure::TimedOut);\n        }",""),
 (PIPE,"slice past the bound","            let len = (self.len - offset).min(max_len(offset).max(1));","            let len = self.len - offset;"),
 (REC,"a failure during set-up re-established","        if !self.established {\n            self.qps[index] = QpState::Down;\n            return self.drained_gone(Gone::FailedDuringSetUp { index });\n        }\n",""),
 (REC,"a gone peer re-established","        if peer_gone || nic_dead || self.gone.is_some() {","        if nic_dead || self.gone.is_some() {"),
 (REC,"never given up late",".filter(|&i| matches!(self.qps[i], QpState::Reconnecting { by: Some(by) } if by <= now))",".filter(|&i| matches!(self.qps[i], QpState::Reconnecting { by: Some(by) } if by < now - Duration::from_secs(1)))"),
 (REC,"given up twice","        if !matches!(self.qps.get(index), Some(QpState::Reconnecting { .. })) {\n            return false;\n        }",""),
 (REC,"the last give-up leaves the peer","        if self.all_down() {\n            self.mark_gone(Gone::GivenUp(why));\n        }",""),
 (REC,"a given-up queue pair takes a replacement","            (_, OldQp::Down) | (QpState::Down, _) => Replacement::Refuse,","            (_, OldQp::Down) => Replacement::Refuse,"),
 (REC,"a live old queue pair not failed","                Replacement::FailOldThenWait\n","                Replacement::Wait\n"),
 (REC,"a closed peer still wanted","        self.qps.fill(QpState::Down);",""),
 (REC,"gone reported twice","        if self.gone_taken {\n            return None;\n        }",""),
 (REC,"the deadline forgotten","                let by = now.checked_add(self.timeout);","                let by = None;"),
 (OUT,"no bound","        if self.queue.len() >= self.max {","        if self.queue.len() > self.max {"),
 (OUT,"never expires","            Some(at) if at <= now => self.queue.pop_front(),","            Some(at) if at < now => self.queue.pop_front(),"),
 (OUT,"out of order","        self.queue.push_back(Waiting {","        self.queue.push_front(Waiting {"),
 (OUT,"overflowed deadline expires at once","            deadline: now.checked_add(timeout),","            deadline: now.checked_add(timeout).or(Some(now)),"),
 (RDV,"a WRITE slice copied to the request's start","            gpu_addr: serve.addr + offset,","            gpu_addr: serve.addr,",PRDV),
 (RDV,"a READ's slot lent before its copy out of the GPU","            *slot = if write {","            *slot = if true {",PRDV),
 (RDV,"a revoked request's use ended while its copy runs","if s.holds_use && (!keep || (s.failed.is_some() && !copying)) {","if s.holds_use && (!keep || s.failed.is_some()) {",PRDV),
 (RDV,"a failed request's slot copied","        if !filled || serve.failed.is_some() {","        if !filled {",PRDV),
 (RDV,"a cancelled request answered","                if !s.cancelled {\n                    actions.push_back(OwnerAction::Reply { id: s.id, status });\n                }","                actions.push_back(OwnerAction::Reply { id: s.id, status });",PRDV),
 (RDV,"a failed request answered while its copy runs","                && !s.replied\n                && !copying\n","                && !s.replied\n",PRDV),
 (RDV,"the owner's deadline off by one",".filter(|s| s.failed.is_none() && s.deadline <= now)",".filter(|s| s.failed.is_none() && s.deadline < now)",PRDV),
 (RDV,"a timed-out request's slots kept","        for id in late {\n            self.take_back_lent(id);\n        }\n","",PRDV),
 (RDV,"no bound on staged requests","        if self.serving.len() >= self.max_requests {","        if self.serving.len() > self.max_requests {",PRDV),
 (RDV,"a credit of the wrong direction honoured","}) if lent_to == id && serve.write == filled => Some((slots, offset, len)),","}) if lent_to == id => Some((slots, offset, len)),",PRDV),
 (RDV,"a slot lent to another request honoured","}) if lent_to == id && serve.write == filled => Some((slots, offset, len)),","}) if serve.write == filled => Some((slots, offset, len)),",PRDV),
 (RDV,"a closed connection's requests answered","                s.cancelled = true;\n                s.failed.get_or_insert(status::FAILED);\n                s.id","                s.failed.get_or_insert(status::FAILED);\n                s.id",PRDV),
 (REQ,"the last failure wins","            a.failure.get_or_insert(why);","            a.failure = Some(why);",PRDV),
 (REQ,"a refusal overrides the cancel","                a.failure.get_or_insert(AskFailure::Refused(status));","                a.failure = Some(AskFailure::Refused(status));",PRDV),
 (REQ,"a credit for the slot past the last","            slot < count\n","            slot <= count\n",PRDV),
 (REQ,"a credit longer than a slot","                && len <= slot_len\n","",PRDV),
 (REQ,"a gone peer's requests not failed","            a.failure.get_or_insert(AskFailure::PeerGone);\n","",PRDV),
 (REQ,"the requester's deadline off by one","if a.deadline.is_some_and(|at| now >= at) {","if a.deadline.is_some_and(|at| now > at) {",PRDV),
 (PC,"a slice past its transfer's end","            let len = (self.lens[transfer] - offset).min(self.windows.slice);","            let len = self.windows.slice;",PPC),
 (PC,"windows all counted done at the first's end","        self.queued = self.queued.saturating_sub(1);","        self.queued = 0;",PPC),
 (PC,"a stopped batch ends before its windows ran","            _ if !self.is_drained() => return None,","            _ if !self.is_drained() && self.stop.is_none() => return None,",PPC),
 (PC,"given up at the revoke","                    export.release_by = now.checked_add(bound);","                    export.release_by = Some(now);",PPC),
 (PC,"the given-up record unbounded","            if self.given_up.len() == GIVEN_UP_KEPT {\n                self.given_up.pop_front();\n            }\n","",PPC),
 (CONN,"a grant of another engine kept","                if d.owner() != self.peer_engine {","                if d.owner() == 0 {"),
 (CONN,"a grant of another engine kept (pair)","                if d.owner() != self.peer_engine {","                if d.owner() == 0 {",PAIR),
 (CONN,"goodbye keeps the peer's grants","                self.remote.clear();\n                Event::Goodbye","                Event::Goodbye",PAIR),
 (CONN,"an unknown revoke told as a revoke","                    None => return Ok(Received::Stale),","                    None => Event::GrantRevoked(grant),"),
 (CONN,"the deadline misses the outbox","            self.outbox.poll_timeout(),\n            self.rendezvous","            None,\n            self.rendezvous"),
 (CONN,"the deadline misses the recovery","            self.recovery.poll_timeout(),\n            self.outbox","            None,\n            self.outbox"),
 (CONN,"the deadline misses the batches","            self.batches.next_deadline(),\n","            None,\n"),
 (CONN,"the deadline misses the batches (pair)","            self.batches.next_deadline(),\n","            None,\n",PAIR),
 (CONN,"a timeout leaves the batches","        self.batches.handle_timeout(now);\n",""),
 (CONN,"the deadline misses the rendezvous","            self.rendezvous.poll_timeout(),\n",""),
 (CONN,"a timeout leaves the rendezvous","        self.rendezvous.handle_timeout(now);\n",""),
 (CONN,"the deadline misses the peer copies","            self.peer_copy.poll_timeout(),\n",""),
 (CONN,"a timeout leaves the peer copies","        self.rendezvous.handle_timeout(now);\n        self.peer_copy.handle_timeout(now)","        self.rendezvous.handle_timeout(now);\n        Vec::new()"),
 (PC,"the peer copies' deadline misses the exports","            .chain(self.exports.poll_timeout())\n            .min()\n    }\n\n    /// The time passed","            .min()\n    }\n\n    /// The time passed"),
 (PC,"the peer copies' timeout leaves the flights","        for flight in self.flights.values_mut() {\n            flight.handle_timeout(now);\n        }\n",""),
 (CONN,"a timeout leaves the batches (pair)","        self.batches.handle_timeout(now);\n","",PAIR),
 (CONN,"sent while it may not","        if can_send {\n            return self.outbox.pop().map(Transmit::Send);","        {\n            return self.outbox.pop().map(Transmit::Send);"),
 (CONN,"expired sent","        if let Some(late) = self.outbox.poll_expired(now) {\n            return Some(Transmit::Expired(late));\n        }\n",""),
 (CONN,"sent after goodbye","        if self.said_goodbye {\n            return Err((SendRefused::Goodbye, token));\n        }\n",""),
 (CONN,"a message past the peer's size queued","        if len > max {\n            return Err((SendRefused::TooLarge { len, max }, token));\n        }\n",""),
 (RCV,"an early completion handed out at once","            .any(|p| p.queue == this.queue && !p.taken && p.seq < this.seq)","            .any(|p| p.queue == this.queue && !p.taken && p.seq < this.seq && false)"),
 (RCV,"one queue's order holds up another's","            .any(|p| p.queue == this.queue && !p.taken && p.seq < this.seq)","            .any(|p| !p.taken && p.seq < this.seq)"),
 (RCV,"a reposted slot keeps its old place","            self.posted += 1;","            self.posted += u64::from(slot == usize::MAX);"),
 (RCV,"a completion handed out twice","        if !fresh || self.early.iter().any(|(s, _)| *s == slot) {","        if self.early.iter().any(|(s, _)| *s == slot) {"),
 (PC,"the release bound off by one",".filter(|(_, e)| e.release_by.is_some_and(|at| now >= at))",".filter(|(_, e)| e.release_by.is_some_and(|at| now > at))",PPC),
]
# An argument keeps the mutants of the files whose path contains it, or
# of the pair test it names ("pair_" keeps every pair test's).
if len(sys.argv)>1:
    muts=[m for m in muts if any(sys.argv[1] in f for f in (m[0],)+m[4:])]
caught=0
for p,name,a,b,*pair in muts:
    orig=open(p).read()
    if pair:
        # The pair test named must catch it.
        module=pair[0]
        args=["--test",module]
    else:
        module={'peer_copy.rs':'peer_copy','gate.rs':'gate','requester.rs':'rendezvous','pipeline.rs':'pipeline','reconnect.rs':'reconnect','outbox.rs':'outbox','batches.rs':'batches','connection.rs':'connection','receives.rs':'receives'}[p.split('/')[-1]]
        args=[module+"::"]
    assert orig.count(a)==1,(name,a)
    try:
        open(p,'w').write(orig.replace(a,b))
        r=subprocess.run(["cargo","test","-q","-p","gdr-proto"]+args,capture_output=True,text=True)
    finally:
        open(p,'w').write(orig)
    ok = r.returncode!=0
    caught+=ok
    # The failing tests, as the summary after "failures:" lists them.
    fails=[l.strip() for l in r.stdout.splitlines() if l.startswith("    ") and re.fullmatch(r"[\w:]+",l.strip())]
    print(("CAUGHT " if ok else "MISSED ")+module+": "+name, fails[:3], flush=True)
print(f"{caught}/{len(muts)} caught")
sys.exit(0 if caught == len(muts) else 1)
