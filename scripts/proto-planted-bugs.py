#!/usr/bin/env python3
# Planted bugs in gdr-proto/src/peer_copy.rs: each is applied alone, the
# crate's peer_copy tests run, and the file restored. Every one must be
# caught (the test suite fails). Run from the repository root.
import subprocess, sys
p='gdr-proto/src/peer_copy.rs'
orig=open(p).read()
muts=[
 ("stop ignored by poll_window","if self.stop.is_some() || self.exhausted() || self.queued >= self.windows.in_flight","if self.exhausted() || self.queued >= self.windows.in_flight"),
 ("one window too many","|| self.queued >= self.windows.in_flight {","|| self.queued > self.windows.in_flight {"),
 ("drained with windows queued","self.queued == 0 && (self.stop.is_some() || self.exhausted())","(self.stop.is_some() || self.exhausted())"),
 ("outcome twice","        self.ended = true;\n        Some(outcome)","        Some(outcome)"),
 ("release of a live grant","Some(e) if e.peer == peer && e.release_by.is_some() =>","Some(e) if e.peer == peer =>"),
 ("release from another peer","Some(e) if e.peer == peer && e.release_by.is_some() =>","Some(e) if e.release_by.is_some() =>"),
 ("release owed sent while in use","            if in_use(peer, grant) {","            if in_use(peer, grant) && false {"),
 ("last stop wins","        self.stop.get_or_insert(why);","        self.stop = Some(why);"),
 ("deadline off by one","if self.deadline.is_some_and(|at| now >= at)","if self.deadline.is_some_and(|at| now > at)"),
 ("given up not recorded","            self.given_up.push_back(grant);","            let _ = grant;"),
 ("bound never expires",".filter(|(_, e)| e.release_by.is_some_and(|at| now >= at))",".filter(|(_, e)| e.release_by.is_some_and(|at| now > at + Duration::from_secs(3600)))"),
]
caught=0
for name,a,b in muts:
    assert orig.count(a)==1,(name,a)
    open(p,'w').write(orig.replace(a,b))
    r=subprocess.run(["cargo","test","-q","-p","gdr-proto","peer_copy"],capture_output=True,text=True)
    ok = r.returncode!=0
    caught+=ok
    fails=[l for l in r.stdout.splitlines() if l.startswith("    peer_copy::")]
    print(("CAUGHT " if ok else "MISSED ")+name, fails[:3], flush=True)
open(p,'w').write(orig)
print(f"{caught}/{len(muts)} caught")
sys.exit(0 if caught == len(muts) else 1)
