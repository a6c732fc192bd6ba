//! The built `gdr` binary: `info` (for people and as JSON) and `uri` on
//! valid and malformed input, and the shape of `bench idle`'s, `bench
//! scale`'s and `bench isolation`'s output on the sim. Runs on any machine:
//! without RDMA or a GPU the backends fall back to the simulation, and
//! `info` must still succeed.

use std::process::{Command, Output};

fn gdr(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gdr"))
        .args(args)
        .output()
        .expect("the gdr binary runs")
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// What `gdr` with `args` printed on stdout; it must succeed.
fn succeeds(args: &[&str]) -> String {
    let out = gdr(args);
    assert!(out.status.success(), "{args:?}: {}", stderr(&out));
    stdout(&out)
}

/// A bench's table in `text`: the words of its header row (the line
/// whose first word is `mode`) and of each row after it.
fn table(text: &str) -> (Vec<&str>, Vec<Vec<&str>>) {
    let mut lines = text
        .lines()
        .skip_while(|l| l.split_whitespace().next() != Some("mode"))
        // A blank line ends the table (another may follow).
        .take_while(|l| !l.trim().is_empty())
        .map(|l| l.split_whitespace().collect::<Vec<_>>());
    let header = lines
        .next()
        .unwrap_or_else(|| panic!("no header row in\n{text}"));
    (header, lines.collect())
}

const HANDLE: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff\
                      00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

#[test]
fn info_reports_every_section_on_any_machine() {
    for args in [&["info"][..], &["--backend", "sim", "info"][..]] {
        let out = gdr(args);
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
        let text = stdout(&out);
        for section in [
            "Libraries",
            "libibverbs",
            "libcuda",
            "nvidia-peermem",
            "memlock",
            "RDMA devices",
            "GPUs",
            "PCIe distance",
            "GPU registration rungs",
            "What to do",
        ] {
            assert!(
                text.contains(section),
                "{args:?}: no {section:?} in\n{text}"
            );
        }
    }
}

#[test]
fn info_json_has_the_report_keys() {
    for args in [
        &["info", "--json"][..],
        &["--backend", "sim", "info", "--json"][..],
    ] {
        let out = gdr(args);
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
        let report: serde_json::Value =
            serde_json::from_slice(&out.stdout).expect("info --json prints JSON");
        for key in [
            "backends",
            "libraries",
            "nvidia",
            "kernel_release",
            "memlock",
            "rdma",
            "gpus",
            "topology",
            "rungs",
            "hints",
        ] {
            assert!(report.get(key).is_some(), "{args:?}: no key {key:?}");
        }
        for lib in ["libibverbs", "librdmacm", "libcuda"] {
            assert!(
                report["libraries"][lib]["soname"].is_string(),
                "{args:?}: {lib}"
            );
        }
        assert!(report["memlock"]["verdict"].is_string());
        assert!(report["rdma"]["devices"].is_array());
        assert!(report["hints"].is_array());
    }
    // Under --backend sim the simulation's devices are listed and probed.
    let out = gdr(&["--backend", "sim", "info", "--json"]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["backends"]["verbs"], "sim");
    assert_eq!(report["rdma"]["devices"][0]["name"], "sim0");
    assert_eq!(report["rungs"]["pairs"][0]["rung"], "dma-buf");
    assert_eq!(
        report["libraries"]["libcuda"]["found"],
        serde_json::Value::Null
    );
}

#[test]
fn uri_decodes_a_valid_uri_and_descriptor() {
    let uri = format!("gdr://v2/device/1/allocation/65536/offset/0/size/4096/ipc/{HANDLE}");
    let out = gdr(&["uri", &uri]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("GPU 1"), "{text}");
    assert!(text.contains("whole allocation"), "{text}");

    let out = gdr(&["uri", "gdr-md:v2:a:b:host:w:1000:rxe0@0+1000=5000/9"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("write only"), "{text}");
    assert!(text.contains("rxe0: 1 segment"), "{text}");
}

#[test]
fn uri_refuses_malformed_input_naming_the_fault() {
    // A trailing slash after the handle.
    let uri = format!("gdr://v1/device/0/size/4096/ipc/{HANDLE}/");
    let out = gdr(&["uri", &uri]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("after the handle"),
        "{}",
        stderr(&out)
    );
    // Rights that do not exist.
    let out = gdr(&["uri", "gdr-md:v2:a:b:host:x:1000:staged"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("rights"), "{}", stderr(&out));
    // Odd hex.
    let out = gdr(&["uri", "--hex", "474"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("odd number"), "{}", stderr(&out));
    assert!(out.stdout.is_empty());
}

/// `--backend real` on a machine without rdma-core's devices cannot be met:
/// the report is still printed, then the reason, and the exit is a failure,
/// not a panic. Where real devices are found it succeeds.
#[test]
fn info_real_reports_even_when_real_cannot_be_met() {
    let out = gdr(&["--backend", "real", "info"]);
    assert_ne!(out.status.code(), Some(101), "panicked: {}", stderr(&out));
    assert!(stdout(&out).contains("Libraries"), "{}", stdout(&out));
    if !out.status.success() {
        assert!(
            stderr(&out).contains("real RDMA verbs asked for"),
            "{}",
            stderr(&out)
        );
        assert!(stdout(&out).contains("backends: real RDMA verbs asked for"));
    }
}

/// `gdr bench idle` on the sim, short: the table's header and one row per
/// mode (the floor first), each of six numbers; with `--json` one object
/// per mode with the figures' keys. A measurement: only its shape is
/// checked.
#[test]
fn bench_idle_prints_a_row_per_mode() {
    let short = [
        "--backend",
        "sim",
        "bench",
        "idle",
        "--seconds",
        "1",
        "--samples",
        "100",
        "--idle-samples",
        "3",
        "--gap-ms",
        "10",
    ];
    let text = succeeds(&short);
    let (header, rows) = table(&text);
    assert_eq!(
        header,
        [
            "mode",
            "idle",
            "%cpu",
            "switches/s",
            "b2b",
            "p50",
            "b2b",
            "p99",
            "idle",
            "p50",
            "idle",
            "p99"
        ],
        "{text}"
    );
    assert_eq!(rows.len(), 3, "{text}");
    for (fields, mode) in rows.iter().zip(["verbs", "caller", "driver"]) {
        let row = fields.join(" ");
        assert_eq!(fields.len(), 7, "{row}");
        assert_eq!(fields[0], mode, "{row}");
        for figure in &fields[1..] {
            let value: f64 = figure
                .parse()
                .unwrap_or_else(|_| panic!("{figure} in {row}"));
            assert!(value >= 0.0, "{row}");
        }
        // A WRITE takes time.
        assert!(fields[3].parse::<f64>().unwrap() > 0.0, "{row}");
    }

    let mut json = short.to_vec();
    json[5] = "0.2";
    json.extend(["--mode", "caller,verbs", "--json"]);
    let text = succeeds(&json);
    let objects: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert_eq!(objects.len(), 2, "{text}");
    for (object, mode) in objects.iter().zip(["caller", "verbs"]) {
        assert_eq!(object["bench"], "idle");
        assert_eq!(object["backend"], "sim");
        assert_eq!(object["mode"], mode);
        assert_eq!(object["size"], 4096);
        assert_eq!(object["b2b_samples"], 100);
        assert_eq!(object["after_idle_samples"], 3);
        assert_eq!(object["gap_ms"], 10);
        for key in [
            "idle_seconds",
            "idle_cpu_pct",
            "voluntary_switches_per_s",
            "b2b_p50_us",
            "b2b_p99_us",
            "after_idle_p50_us",
            "after_idle_p99_us",
        ] {
            assert!(object[key].as_f64().is_some(), "{key} in {object}");
        }
    }
}

/// `gdr bench scale` on the sim, short: the table has a row per mode and
/// thread count (1 and 2), each with a positive rate, the ratio 1 at
/// T = 1; with `--json` one object per point, then the set-up of a few
/// peers (sequential, concurrent) and the idle CPU with them. A
/// measurement: only its shape is checked.
/// The columns of `gdr bench scale`'s table (`--rounds` adds `min` and
/// `max` after `req/s`).
const SCALE_HEADER: [&str; 10] = [
    "mode",
    "threads",
    "requests",
    "seconds",
    "req/s",
    "req/s/thread",
    "ratio",
    "cores",
    "on-cpu",
    "waits/k",
];

/// The rows of `gdr bench scale --threads 1,2` with the default modes, in
/// order: (mode, threads).
const SCALE_ROWS: [(&str, &str); 6] = [
    ("bare", "1"),
    ("bare", "2"),
    ("one-engine", "1"),
    ("one-engine", "2"),
    ("engines", "1"),
    ("engines", "2"),
];

#[test]
fn bench_scale_prints_a_rate_per_mode_and_thread_count() {
    let short = [
        "--backend",
        "sim",
        "bench",
        "scale",
        "--threads",
        "1,2",
        "--seconds",
        "0.1",
        "--warmup",
        "0.02",
    ];
    let text = succeeds(&short);
    let (header, rows) = table(&text);
    assert_eq!(header, SCALE_HEADER, "{text}");
    let expected = SCALE_ROWS;
    assert_eq!(rows.len(), expected.len(), "{text}");
    // Then one engine against the others, at each T.
    let compared: Vec<Vec<&str>> = text
        .lines()
        .skip_while(|l| !l.starts_with("threads"))
        .skip(1)
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(compared.len(), 2, "{text}");
    for (fields, threads) in compared.iter().zip(["1", "2"]) {
        assert_eq!(fields.len(), 3, "{text}");
        assert_eq!(fields[0], threads, "{text}");
        for figure in &fields[1..] {
            let value: f64 = figure.parse().unwrap_or_else(|_| panic!("{text}"));
            assert!(value > 0.0, "{text}");
        }
    }
    // Each mode's ratio is to its own T = 1.
    assert_eq!(compared[0][1], "1.00", "{text}");
    for (fields, (mode, threads)) in rows.iter().zip(expected) {
        let row = fields.join(" ");
        assert_eq!(fields.len(), 10, "{row}");
        assert_eq!((fields[0], fields[1]), (mode, threads), "{row}");
        let figures: Vec<f64> = fields[2..]
            .iter()
            .map(|figure| {
                figure
                    .parse()
                    .unwrap_or_else(|_| panic!("{figure} in {row}"))
            })
            .collect();
        // Rates, the ratio, the busy cores and the share on a CPU are
        // positive; voluntary switches may be none.
        assert!(figures[..7].iter().all(|&v| v > 0.0), "{row}");
        assert!(figures[6] <= 1.05, "a share of the time: {row}");
        assert!(figures[7] >= 0.0, "{row}");
        if threads == "1" {
            assert_eq!(fields[6], "1.00", "{row}");
        }
    }

    let mut json = short.to_vec();
    json.extend([
        "--modes",
        "engines,bare",
        "--batch",
        "1",
        "--peers",
        "5",
        "--connect-threads",
        "2",
        "--idle-seconds",
        "0.1",
        "--json",
    ]);
    let text = succeeds(&json);
    let objects: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let modes: Vec<(&str, u64)> = objects
        .iter()
        .map(|o| {
            assert_eq!(o["bench"], "scale", "{o}");
            assert_eq!(o["backend"], "sim", "{o}");
            (
                o["mode"].as_str().unwrap(),
                o["threads"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    assert_eq!(
        modes,
        [
            ("engines", 1),
            ("engines", 2),
            ("bare", 1),
            ("bare", 2),
            ("setup", 1),
            ("idle", 0),
            ("setup", 2)
        ],
        "{text}"
    );
    for point in &objects[..4] {
        assert_eq!(point["batch"], 1, "{point}");
        assert_eq!(point["size"], 4096, "{point}");
        assert!(point["requests"].as_u64().unwrap() > 0, "{point}");
        for key in [
            "seconds",
            "ops_per_s",
            "ops_per_s_per_thread",
            "ratio",
            "cpu_cores",
            "measuring_on_cpu",
        ] {
            assert!(point[key].as_f64().unwrap() > 0.0, "{key} in {point}");
        }
        for key in ["voluntary_switches", "involuntary_switches"] {
            assert!(point[key].as_u64().is_some(), "{key} in {point}");
        }
    }
    for set_up in [&objects[4], &objects[6]] {
        assert_eq!(set_up["peers_asked"], 5, "{set_up}");
        assert_eq!(set_up["peers"], 5, "{set_up}");
        assert_eq!(set_up["accepted"], 5, "{set_up}");
        assert_eq!(set_up["failures"], 0, "{set_up}");
        assert!(set_up["error"].is_null(), "{set_up}");
        assert!(set_up["ms_per_peer"].as_f64().unwrap() > 0.0, "{set_up}");
    }
    assert_eq!(objects[5]["peers"], 5, "{}", objects[5]);
    assert!(
        objects[5]["idle_cpu_pct"].as_f64().is_some(),
        "{}",
        objects[5]
    );
}

/// `gdr bench scale --rounds 3` on the sim: a row per mode and thread
/// count, its req/s the median of the rounds' between their lowest and
/// highest (two more columns), then the comparison from the medians with
/// the range of the rounds' own; with `--json` an object per row with each
/// round's figures, then one per T of the comparison.
#[test]
fn bench_scale_rounds_print_the_median_and_the_range_of_the_rounds() {
    let short = [
        "--backend",
        "sim",
        "bench",
        "scale",
        "--threads",
        "1,2",
        "--seconds",
        "0.05",
        "--warmup",
        "0.02",
    ];
    let mut rounds = short.to_vec();
    rounds.extend(["--rounds", "3"]);
    let text = succeeds(&rounds);
    assert!(text.contains("3 rounds"), "{text}");
    let (header, rows) = table(&text);
    assert_eq!(
        header,
        [&SCALE_HEADER[..5], &["min", "max"], &SCALE_HEADER[5..]].concat(),
        "{text}"
    );
    let expected = SCALE_ROWS;
    assert_eq!(rows.len(), expected.len(), "{text}");
    for (fields, (mode, threads)) in rows.iter().zip(expected) {
        let row = fields.join(" ");
        assert_eq!(fields.len(), 12, "{row}");
        assert_eq!((fields[0], fields[1]), (mode, threads), "{row}");
        let figure = |i: usize| -> f64 {
            fields[i]
                .parse()
                .unwrap_or_else(|_| panic!("{} in {row}", fields[i]))
        };
        let (median, min, max) = (figure(4), figure(5), figure(6));
        assert!(0.0 < min && min <= median && median <= max, "{row}");
        if threads == "1" {
            assert_eq!(fields[8], "1.00", "{row}");
        }
    }
    let compared: Vec<Vec<&str>> = text
        .lines()
        .skip_while(|l| !l.starts_with("threads"))
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(
        compared.first().map(Vec::as_slice),
        Some(
            &[
                "threads", "scaling", "min", "max", "per", "engines", "min", "max"
            ][..]
        ),
        "{text}"
    );
    assert_eq!(compared.len(), 3, "{text}");
    for (fields, threads) in compared[1..].iter().zip(["1", "2"]) {
        assert_eq!(fields.len(), 7, "{text}");
        assert_eq!(fields[0], threads, "{text}");
        let figures: Vec<f64> = fields[1..]
            .iter()
            .map(|f| f.parse().unwrap_or_else(|_| panic!("{f} in {text}")))
            .collect();
        assert!(figures.iter().all(|&v| v > 0.0), "{text}");
        // The rounds' range.
        assert!(
            figures[1] <= figures[2] && figures[4] <= figures[5],
            "{text}"
        );
    }
    assert_eq!(compared[1][1..4], ["1.00", "1.00", "1.00"], "{text}");

    let mut json = short.to_vec();
    json.extend(["--rounds", "2", "--modes", "bare,one-engine", "--json"]);
    let text = succeeds(&json);
    let objects: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let modes: Vec<(&str, u64)> = objects
        .iter()
        .map(|o| (o["mode"].as_str().unwrap(), o["threads"].as_u64().unwrap()))
        .collect();
    assert_eq!(
        modes,
        [
            ("bare", 1),
            ("bare", 2),
            ("one-engine", 1),
            ("one-engine", 2),
            ("compare", 1),
            ("compare", 2)
        ],
        "{text}"
    );
    for row in &objects[..4] {
        assert_eq!(row["rounds"], 2, "{row}");
        let each = row["ops_per_s_rounds"].as_array().unwrap();
        assert_eq!(each.len(), 2, "{row}");
        let (a, b) = (each[0].as_f64().unwrap(), each[1].as_f64().unwrap());
        let median = row["ops_per_s"].as_f64().unwrap();
        // Of two rounds, the mean of both (within the rounding to 0.1).
        assert!((median - (a + b) / 2.0).abs() <= 0.1, "{row}");
        assert_eq!(row["ops_per_s_min"].as_f64().unwrap(), a.min(b), "{row}");
        assert_eq!(row["ops_per_s_max"].as_f64().unwrap(), a.max(b), "{row}");
        for key in [
            "requests_rounds",
            "seconds_rounds",
            "ratio_rounds",
            "cpu_cores_rounds",
            "measuring_on_cpu_rounds",
            "voluntary_switches_rounds",
            "involuntary_switches_rounds",
        ] {
            assert_eq!(row[key].as_array().map(Vec::len), Some(2), "{key} in {row}");
        }
        for key in [
            "requests",
            "seconds",
            "ratio",
            "cpu_cores",
            "measuring_on_cpu",
        ] {
            assert!(row[key].as_f64().unwrap() > 0.0, "{key} in {row}");
        }
    }
    for c in &objects[4..] {
        assert_eq!(c["rounds"], 2, "{c}");
        assert!(c["scaling_vs_bare"].as_f64().unwrap() > 0.0, "{c}");
        assert_eq!(
            c["scaling_vs_bare_rounds"].as_array().map(Vec::len),
            Some(2),
            "{c}"
        );
        assert!(c["per_engines"].is_null(), "no engines mode: {c}");
    }
}

/// `gdr bench isolation` on the sim: one row per phase and the ratio line
/// as before; with `--rounds 2` a row per round and phase (alternating),
/// then a row per phase over the rounds (percentiles the medians of the
/// rounds', max the largest, counts the sums) and the ratio with its
/// range; with `--json` an object per phase over the rounds with each
/// round's figures, then one of the ratios.
#[test]
fn bench_isolation_rounds_print_the_medians_and_the_rounds_ratios() {
    let words = |l: &str| l.split_whitespace().map(str::to_owned).collect::<Vec<_>>();
    let header = [
        "phase", "samples", "p50", "p90", "p99", "p99.9", "max", "B", "batches", "B", "copies",
        "slow", "calls",
    ];
    let figure = |row: &[String], i: usize| -> f64 {
        row[i]
            .parse()
            .unwrap_or_else(|_| panic!("{} in {row:?}", row[i]))
    };
    let single = [
        "--backend",
        "sim",
        "bench",
        "isolation",
        "--seconds",
        "0.05",
    ];
    let text = succeeds(&single);
    let lines: Vec<Vec<String>> = text
        .lines()
        .skip_while(|l| !l.starts_with("phase"))
        .map(words)
        .collect();
    assert_eq!(lines.len(), 4, "{text}");
    assert_eq!(lines[0], header, "{text}");
    assert_eq!(
        (lines[1][0].as_str(), lines[2][0].as_str()),
        ("alone", "beside-peer-copy")
    );
    assert!(
        text.lines()
            .last()
            .unwrap()
            .starts_with("beside-peer-copy / alone: p50 x"),
        "{text}"
    );
    assert!(!text.contains("rounds"), "{text}");

    let rounds = [&single[..4], &["--seconds", "0.2", "--rounds", "2"]].concat();
    let text = succeeds(&rounds);
    assert!(text.contains("2 rounds"), "{text}");
    let each: Vec<Vec<String>> = text
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("round"))
        .take_while(|l| !l.trim().is_empty())
        .map(words)
        .collect();
    assert_eq!(each.len(), 5, "{text}");
    assert_eq!(each[0], [&["round"][..], &header].concat(), "{text}");
    let per_round: Vec<(&str, &str)> = each[1..]
        .iter()
        .map(|r| (r[0].as_str(), r[1].as_str()))
        .collect();
    assert_eq!(
        per_round,
        [
            ("1", "alone"),
            ("1", "beside-peer-copy"),
            ("2", "alone"),
            ("2", "beside-peer-copy")
        ],
        "{text}"
    );
    let over: Vec<Vec<String>> = text
        .lines()
        .skip_while(|l| !l.starts_with("over the 2 rounds"))
        .skip(1)
        .map(words)
        .collect();
    assert_eq!(over.len(), 4, "{text}");
    assert_eq!(over[0], header, "{text}");
    for (row, phase) in over[1..3].iter().zip(["alone", "beside-peer-copy"]) {
        assert_eq!(row[0], phase, "{text}");
        let rounds: Vec<&Vec<String>> = each[1..].iter().filter(|r| r[1] == phase).collect();
        // Samples: the sum of the rounds'.
        let samples: u64 = rounds.iter().map(|r| r[2].parse::<u64>().unwrap()).sum();
        assert_eq!(row[1], samples.to_string(), "{text}");
        // p50 to p99.9: of two rounds, the mean of both (within the
        // rounding to 0.1); max: the larger.
        for i in 2..6 {
            let mean = (figure(rounds[0], i + 1) + figure(rounds[1], i + 1)) / 2.0;
            assert!((figure(row, i) - mean).abs() <= 0.11, "column {i}: {text}");
        }
        let max = figure(rounds[0], 7).max(figure(rounds[1], 7));
        assert_eq!(figure(row, 6), max, "{text}");
        let percentiles: Vec<f64> = (2..7).map(|i| figure(row, i)).collect();
        assert!(percentiles.windows(2).all(|w| w[0] <= w[1]), "{text}");
        if phase == "alone" {
            assert_eq!(row[7..], ["-", "-", "-"], "{text}");
        } else {
            assert!(figure(row, 7) > 0.0, "B's batches: {text}");
        }
    }
    // beside-peer-copy / alone, the median ... : p50 xM [xL, xH], p99 xM [xL, xH]
    let ratio = &over[3];
    assert_eq!(ratio[..3], ["beside-peer-copy", "/", "alone,"], "{text}");
    let xs: Vec<f64> = ratio
        .iter()
        .filter_map(|w| w.trim_start_matches('[').strip_prefix('x'))
        .map(|w| w.trim_end_matches([',', ']']).parse().unwrap())
        .collect();
    assert_eq!(xs.len(), 6, "{text}");
    for r in xs.chunks(3) {
        let (median, low, high) = (r[0], r[1], r[2]);
        assert!(0.0 < low && low <= median && median <= high, "{text}");
    }

    let json = [&rounds[..], &["--json"]].concat();
    let text = succeeds(&json);
    let objects: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let phases: Vec<&str> = objects
        .iter()
        .map(|o| o["phase"].as_str().unwrap())
        .collect();
    assert_eq!(phases, ["alone", "beside-peer-copy", "ratio"], "{text}");
    for o in &objects[..2] {
        assert_eq!(o["rounds"], 2, "{o}");
        for key in ["p50_us", "p90_us", "p99_us", "p999_us", "max_us"] {
            let each = o[format!("{key}_rounds")].as_array().unwrap();
            assert_eq!(each.len(), 2, "{key} in {o}");
            let (a, b) = (each[0].as_f64().unwrap(), each[1].as_f64().unwrap());
            let expected = if key == "max_us" {
                a.max(b)
            } else {
                (a + b) / 2.0
            };
            assert!(
                (o[key].as_f64().unwrap() - expected).abs() <= 0.011,
                "{key} in {o}"
            );
        }
        for key in ["samples", "b_batches", "b_copies", "slow_calls"] {
            let each = o[format!("{key}_rounds")].as_array().unwrap();
            let sum: u64 = each.iter().map(|v| v.as_u64().unwrap()).sum();
            assert_eq!(o[key].as_u64(), Some(sum), "{key} in {o}");
        }
    }
    let ratio = &objects[2];
    for p in ["p50", "p99"] {
        let each = ratio[format!("{p}_ratio_rounds")].as_array().unwrap();
        assert_eq!(each.len(), 2, "{ratio}");
        let (a, b) = (each[0].as_f64().unwrap(), each[1].as_f64().unwrap());
        let median = ratio[format!("{p}_ratio")].as_f64().unwrap();
        assert!((median - (a + b) / 2.0).abs() <= 1e-4, "{ratio}");
        assert_eq!(
            ratio[format!("{p}_ratio_min")].as_f64(),
            Some(a.min(b)),
            "{ratio}"
        );
        assert_eq!(
            ratio[format!("{p}_ratio_max")].as_f64(),
            Some(a.max(b)),
            "{ratio}"
        );
    }
}
