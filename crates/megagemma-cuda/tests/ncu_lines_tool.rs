//! `tools/ncu_lines.py` (Nsight Compute's per-instruction counts by source line) agrees with the
//! engine: its copy of `kernel_source` gives the text NVRTC compiles, character for character, so
//! its line numbers are NVRTC's; and it joins a profile with a CUBIN's line table as intended (a
//! small made-up profile and `nvdisasm -gi` listing; no GPU needed).

use megagemma_cuda::compile::{kernel_source, KERNEL_FILES};
use std::path::PathBuf;
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn tool() -> Command {
    let mut c = Command::new("python3");
    c.arg(root().join("tools/ncu_lines.py"));
    c
}

#[test]
fn the_tool_sees_every_kernel_file_as_nvrtc_does() {
    for (file, _) in KERNEL_FILES {
        let out = tool().args(["--source", file]).output().expect("python3 runs");
        assert!(out.status.success(), "{file}: {}", String::from_utf8_lossy(&out.stderr));
        let expect = kernel_source(file).expect("kernel source");
        let got = String::from_utf8(out.stdout).unwrap();
        assert!(
            got == expect,
            "{file}: the tool's source differs from kernel_source ({} vs {} bytes)",
            got.len(),
            expect.len()
        );
    }
}

#[test]
fn a_profile_is_joined_with_its_line_table() {
    let dir = std::env::temp_dir().join(format!("megagemma-ncu-lines-{}", std::process::id()));
    let kernels = dir.join("kernels");
    let cubins = dir.join("cubins");
    std::fs::create_dir_all(&kernels).unwrap();
    std::fs::create_dir_all(&cubins).unwrap();
    // Lines 1-3 of k.cu after common.cuh's one line is inlined at line 1.
    std::fs::write(kernels.join("common.cuh"), "#pragma once\n// common\n").unwrap();
    std::fs::write(
        kernels.join("k.cu"),
        "#include \"common.cuh\"\nint setup();\nint body_loop();\nvoid top() { setup(); body_loop(); }\nENTRY(kern)\n",
    )
    .unwrap();
    std::fs::write(cubins.join("k-0123.cubin"), b"not read: the listing comes from NVDISASM").unwrap();
    std::fs::write(cubins.join("other-4567.cubin"), b"").unwrap();
    // An nvdisasm stand-in: `k` has the profiled instructions, `other` has none.
    let listing = dir.join("k.sass");
    std::fs::write(
        &listing,
        ".text.kern:\n\
         \t//## File \"/k.cu\", line 2 inlined at \"/k.cu\", line 4\n\
         \t//## File \"/k.cu\", line 4 inlined at \"/k.cu\", line 5\n\
         \t//## File \"/k.cu\", line 5\n\
         \x20       /*0000*/                   LDC R1, c[0x0][0x28] ;\n\
         \t//## File \"/k.cu\", line 3 inlined at \"/k.cu\", line 4\n\
         \t//## File \"/k.cu\", line 4 inlined at \"/k.cu\", line 5\n\
         \t//## File \"/k.cu\", line 5\n\
         \x20       /*0010*/                   IMAD R2, R3, R4, RZ ;\n\
         \x20       /*0020*/              @!P0 BRA `(.L_x_1) ;\n\
         \t//## File \"/k.cu\", line 5\n\
         \x20       /*0030*/                   EXIT ;\n",
    )
    .unwrap();
    let fake = dir.join("nvdisasm");
    std::fs::write(&fake, format!("#!/bin/sh\ncase \"$2\" in *k-0123.cubin) cat {} ;; esac\n", listing.display()))
        .unwrap();
    Command::new("chmod").arg("+x").arg(&fake).status().unwrap();
    let csv = dir.join("sass.csv");
    std::fs::write(
        &csv,
        "\"Kernel Name\",\"kern\",\n\
         \"Address\",\"Source\",\"Warp Stall Sampling (All Samples)\",\"Instructions Executed\"\n\
         \"0x7f0000001000\",\"      LDC R1, c[0x0][0x28]\",\"1\",\"16\"\n\
         \"0x7f0000001010\",\"      IMAD R2, R3, R4, RZ\",\"3\",\"160\"\n\
         \"0x7f0000001020\",\"      @!P0 BRA 0x7f0000001040\",\"0\",\"160\"\n\
         \"0x7f0000001030\",\"      EXIT\",\"0\",\"16\"\n",
    )
    .unwrap();
    let out = tool()
        .env("NVDISASM", &fake)
        .arg(&csv)
        .arg(&cubins)
        .arg("--kernels")
        .arg(&kernels)
        .output()
        .expect("python3 runs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    // 352 warp instructions over the 16 warps that ran the first one; 4 stall samples.
    assert!(text.contains("=== launch 0: kern (k-0123.cubin)"), "{text}");
    assert!(text.contains("kern: 352 warp instructions over 16 warps (22 per warp), 4 stall samples"), "{text}");
    // By call site (the frame below the entry): line 4 holds all but the exit (whose only frame is
    // the entry's line).
    assert!(text.contains("      21.0  95.5% 100.0%  L4: void top() { setup(); body_loop(); }"), "{text}");
    // By innermost line: line 3's two instructions (20 per warp), line 2's one, the exit's.
    assert!(text.contains("      20.0  90.9%  75.0%  L3: int body_loop();"), "{text}");
    assert!(text.contains("       1.0   4.5%  25.0%  L2: int setup();"), "{text}");
    assert!(text.contains("       1.0   4.5%   0.0%  L5: ENTRY(kern)"), "{text}");
    // Executed once per warp: the LDC (site line 4) and the EXIT (its only frame, line 5).
    assert!(text.contains("(the fixed path): 2 instructions"), "{text}");
    std::fs::remove_dir_all(&dir).ok();
}
