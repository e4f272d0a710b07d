//! `fo shard` prints one row per mesh coordinate and rejects bad input with a message.
use std::process::Command;

fn fo(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_fo"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn prints_every_coordinate_of_a_strided_layout() {
    let (ok, out, err) = fo(&[
        "shard",
        "--shape",
        "10,7",
        "--mesh",
        "2,3",
        "--placements",
        "SS0:3,S0",
    ]);
    assert!(ok, "{err}");
    assert!(
        out.contains("_StridedShard(dim=0, sf=3), Shard(dim=0)"),
        "{out}"
    );
    // rank 5 = coord [1, 2] holds row 9 only; rank 1 holds rows 4..6.
    let row5 = out.lines().find(|l| l.starts_with("5 ")).unwrap();
    assert!(
        row5.contains("[1, 7]") && row5.contains("[9, 0]") && row5.contains("[9,10) x [0,7)"),
        "{row5}"
    );
    let row1 = out.lines().find(|l| l.starts_with("1 ")).unwrap();
    assert!(row1.contains("[4,6)"), "{row1}");
    assert_eq!(out.lines().count(), 2 + 6);
}

#[test]
fn marks_non_box_shards_and_empty_ones() {
    let (ok, out, _) = fo(&[
        "shard",
        "--shape",
        "6",
        "--mesh",
        "4",
        "--placements",
        "SS0:2",
    ]);
    assert!(ok);
    let row0 = out.lines().find(|l| l.starts_with("0 ")).unwrap();
    assert!(
        row0.contains(" no ") && row0.contains("[0,1)+[3,4)"),
        "{row0}"
    );
    let (_, out, _) = fo(&["shard", "--shape", "6", "--mesh", "4", "--placements", "S0"]);
    let row3 = out.lines().find(|l| l.starts_with("3 ")).unwrap();
    assert!(
        row3.contains("[0]") && row3.contains("[6]") && row3.contains("{}"),
        "{row3}"
    );
}

#[test]
fn bad_input_exits_nonzero_with_the_reason() {
    let (ok, _, err) = fo(&[
        "shard",
        "--shape",
        "10",
        "--mesh",
        "2",
        "--placements",
        "S1",
    ]);
    assert!(!ok);
    assert!(err.contains("placements[0].dim"), "{err}");
    let (ok, _, err) = fo(&["shard", "--shape", "10", "--mesh", "2", "--placements", "Q"]);
    assert!(!ok && err.contains("\"Q\""), "{err}");
    let (ok, _, err) = fo(&["frobnicate"]);
    assert!(
        !ok && err.contains("unrecognized subcommand 'frobnicate'"),
        "{err}"
    );
}
