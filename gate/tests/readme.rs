//! The README's "What the main job prints" is the main job's output, not a memory of it: its
//! table header and its `short` row (tokens, statuses, engine digest) are read from the README
//! and checked against a real `gate m1` run on that prompt (the oracle left out by a Python
//! without torch, so its two columns are NOT CHECKED here and only the others are compared).

use crate::common;

use common::repo;

/// The fenced block after the heading "What the main job prints".
fn sample() -> String {
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let at = readme
        .find("## What the main job prints")
        .expect("README has the main job's sample");
    let rest = &readme[at..];
    let open = rest.find("```\n").unwrap() + 4;
    let close = open + rest[open..].find("```").unwrap();
    rest[open..close].to_string()
}

fn columns(line: &str) -> Vec<String> {
    line.split_whitespace().map(str::to_string).collect()
}

#[test]
fn the_readme_sample_is_what_gate_m1_prints() {
    let sample = sample();
    let header = sample
        .lines()
        .find(|l| l.starts_with("prompt "))
        .expect("a table header in the sample");
    let short = sample
        .lines()
        .find(|l| l.starts_with("short "))
        .expect("a short row in the sample");
    let dir = tempfile::tempdir().unwrap();
    let block = dir.path().join("block");
    std::fs::create_dir_all(&block).unwrap();
    std::fs::write(block.join("torch.py"), "raise ImportError('blocked')\n").unwrap();
    let out = common::gate()
        .current_dir(repo())
        .args(["m1", "--prompts", "frozen", "--only", "short"])
        .args(["--model", "fixtures/tiny-qwen3-moe"])
        .arg("--work")
        .arg(dir.path().join("work"))
        .env("TRACEGATE_PYTHON", repo().join(".venv/bin/python"))
        .env("PYTHONPATH", &block)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let ran_header = stdout
        .lines()
        .find(|l| l.starts_with("prompt "))
        .unwrap_or_else(|| panic!("no table header:\n{stdout}"));
    assert_eq!(
        columns(ran_header),
        columns(header),
        "the README's table header"
    );
    let ran = columns(
        stdout
            .lines()
            .find(|l| l.starts_with("short "))
            .unwrap_or_else(|| panic!("no short row:\n{stdout}")),
    );
    let want = columns(short);
    // prompt, tokens, stable, matches, generation: as printed; agrees and generation_oracle
    // need torch (NOT CHECKED here); the engine digest, the last column, as printed.
    assert_eq!(
        ran[..5],
        want[..5],
        "README: {short}\nrun:    {}",
        ran.join(" ")
    );
    assert_eq!(
        ran.last(),
        want.last(),
        "README: {short}\nrun:    {}",
        ran.join(" ")
    );
}
