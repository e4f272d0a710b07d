//! The NVRTC search against the pip wheels (no GPU needed). scripts/test.sh installs the
//! pinned NVRTC 12 and 13 wheels and names their libraries in `FO_TEST_NVRTC12_LIBRARY`
//! and `FO_TEST_NVRTC13_LIBRARY`; without them the tests that load a wheel skip, saying so.
use std::path::PathBuf;

use super::*;

/// The wheel library of NVRTC `major` named by `FO_TEST_NVRTC{major}_LIBRARY`, or None
/// (printing why the caller skips).
pub(crate) fn test_wheel(major: i32) -> Option<String> {
    let var = format!("FO_TEST_NVRTC{major}_LIBRARY");
    match std::env::var(&var) {
        Ok(p) if Path::new(&p).is_file() => Some(p),
        Ok(p) => {
            eprintln!("skipped: {var}={p} is not a file");
            None
        }
        Err(_) => {
            eprintln!("skipped: {var} (the NVRTC {major} wheel's library) is not set");
            None
        }
    }
}

/// The `--target` directory the wheel was installed into (its `site-packages`).
fn wheel_site(lib: &str) -> PathBuf {
    let rel = WHEEL_LIBRARIES
        .iter()
        .find(|r| lib.ends_with(*r))
        .unwrap_or_else(|| panic!("{lib} is not at a wheel's place ({WHEEL_LIBRARIES:?})"));
    PathBuf::from(&lib[..lib.len() - rel.len()])
}

/// A fresh scratch directory for one test.
fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("fo-nvrtc-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Links `site/<rel's first two components>` to the wheel's same directory, so `site`
/// holds the wheel's layout (`nvidia/cu13` or `nvidia/cuda_nvrtc`).
fn link_wheel(site: &Path, wheel_lib: &str) {
    let rel = WHEEL_LIBRARIES
        .iter()
        .find(|r| wheel_lib.ends_with(*r))
        .unwrap();
    let pkg: PathBuf = Path::new(rel).components().take(2).collect();
    std::fs::create_dir_all(site.join("nvidia")).unwrap();
    std::os::unix::fs::symlink(wheel_site(wheel_lib).join(&pkg), site.join(&pkg)).unwrap();
}

const NO_NAMES: [&str; 0] = [];

/// The search with neither `FO_NVRTC_LIBRARY` nor names for the loader's path: only the
/// places `loaded` and `venv` lead to.
fn load_from_places(loaded: &[String], venv: Option<&Path>) -> Result<NvrtcLib> {
    load(&Search {
        explicit: None,
        loaded,
        venv,
        names: &NO_NAMES,
    })
}

#[test]
fn fo_nvrtc_library_is_that_file_or_an_error_naming_it() {
    let search = |p| Search {
        explicit: Some(p),
        loaded: &[],
        venv: None,
        names: &SONAMES,
    };
    let e = load(&search("/nonexistent/libnvrtc.so.13"))
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("FO_NVRTC_LIBRARY=/nonexistent/libnvrtc.so.13: ") && e.contains("No such file"),
        "{e}"
    );
    // A library that loads but is not NVRTC: named, with the function it lacks.
    let libc_path = dl::loaded_libraries()
        .into_iter()
        .find(|l| l.contains("/libc.so"))
        .unwrap();
    let e = load(&search(&libc_path)).err().unwrap().to_string();
    assert!(
        e.contains(&format!(
            "FO_NVRTC_LIBRARY={libc_path}: {libc_path}: no symbol nvrtc"
        )),
        "{e}"
    );
}

#[test]
fn each_wheel_loads_through_fo_nvrtc_library_as_its_own_major() {
    for major in [12, 13] {
        let Some(wheel) = test_wheel(major) else {
            continue;
        };
        let l = load(&Search {
            explicit: Some(&wheel),
            loaded: &[],
            venv: None,
            names: &NO_NAMES,
        })
        .unwrap();
        assert_eq!(
            (l.path.as_str(), l.found),
            (wheel.as_str(), Found::Explicit)
        );
        assert_eq!(l.version.0, major, "{wheel}");
        let archs = l.supported_archs().unwrap();
        assert!(archs.contains(&80) && archs.contains(&90), "{archs:?}");
        let e = l.check("nvrtcCompileProgram", 6).unwrap_err().to_string();
        assert!(
            e.contains(&format!("nvrtcCompileProgram ({wheel}, NVRTC {major}."))
                && e.contains("NVRTC_ERROR_COMPILATION (6)"),
            "{e}"
        );
    }
}

/// torch's layout: its libraries in `site-packages/torch/lib`, NVRTC in the wheel's
/// directory beside it, nothing on LD_LIBRARY_PATH (the search gets no names at all).
#[test]
fn the_wheels_are_found_under_site_packages_without_ld_library_path() {
    let (Some(w12), Some(w13)) = (test_wheel(12), test_wheel(13)) else {
        return;
    };
    let root = scratch("site");
    // A site-packages holding only the CUDA 12 wheel, found from a loaded torch library.
    let site12 = root.join("a/lib/python3.11/site-packages");
    link_wheel(&site12, &w12);
    let torch = format!("{}/torch/lib/libtorch_cuda.so", site12.display());
    let l = load_from_places(&[torch], None).unwrap();
    let want = site12.join(WHEEL_LIBRARIES[1]);
    assert_eq!(
        (PathBuf::from(&l.path), l.found, l.version.0),
        (want, Found::Wheel, 12)
    );
    // A venv holding both: CUDA 13's is taken first, found through $VIRTUAL_ENV alone.
    let venv = root.join("venv");
    let site = venv.join("lib/python3.12/site-packages");
    link_wheel(&site, &w13);
    link_wheel(&site, &w12);
    let libc = "/usr/lib/x86_64-linux-gnu/libc.so.6".to_string();
    let l = load_from_places(&[libc], Some(&venv)).unwrap();
    let want = site.join(WHEEL_LIBRARIES[0]);
    assert_eq!(
        (PathBuf::from(&l.path), l.found, l.version.0),
        (want, Found::Wheel, 13)
    );
    std::fs::remove_dir_all(&root).unwrap();
}

/// The copy torch loaded is used as is: here the test loads the wheel first, by its path,
/// as torch's lazy NVRTC loader would.
#[test]
fn an_nvrtc_already_in_the_process_is_used_before_any_search() {
    let Some(w12) = test_wheel(12) else {
        return;
    };
    // SAFETY: the NVRTC wheel's library; the handle stays open for the process.
    unsafe { dl::open(&w12, libc::RTLD_NOW | libc::RTLD_LOCAL) }.unwrap();
    // Only this copy from the process's list: other tests may load the other wheel.
    let loaded: Vec<String> = dl::loaded_libraries()
        .into_iter()
        .filter(|l| l.as_str() == w12 || l.ends_with("/libc.so.6"))
        .collect();
    assert!(loaded.contains(&w12), "{loaded:?}");
    let l = load_from_places(&loaded, None).unwrap();
    assert_eq!(
        (l.path.as_str(), l.found, l.version.0),
        (w12.as_str(), Found::Loaded, 12)
    );
}

#[test]
fn a_missing_nvrtc_is_an_error_naming_every_place_tried() {
    let root = scratch("missing");
    let site = root.join("lib/python3.11/site-packages");
    std::fs::create_dir_all(&site).unwrap();
    // Listed as loaded but not in the process: RTLD_NOLOAD refuses it, the search goes on.
    let loaded = [
        format!("{}/torch/lib/libtorch_cuda.so", site.display()),
        "/nonexistent/lib/libnvrtc.so.13".to_string(),
    ];
    let e = load(&Search {
        explicit: None,
        loaded: &loaded,
        venv: None,
        names: &["libnvrtc-fo-absent.so.13"],
    })
    .err()
    .unwrap()
    .to_string();
    for place in [
        "the NVRTC library (libnvrtc.so.13 or libnvrtc.so.12) could not be loaded; tried: ",
        "a libnvrtc.so* already loaded in this process (none)",
        &format!(
            "{}/nvidia/cu13/lib/libnvrtc.so.13 (no such file)",
            site.display()
        ),
        &format!(
            "{}/nvidia/cuda_nvrtc/lib/libnvrtc.so.12 (no such file)",
            site.display()
        ),
        "libnvrtc-fo-absent.so.13: ",
        "Set FO_NVRTC_LIBRARY to its path",
    ] {
        assert!(e.contains(place), "{place:?} not in: {e}");
    }
    let e = load_from_places(&[], None).err().unwrap().to_string();
    assert!(
        e.contains("no site-packages directory among the loaded libraries or $VIRTUAL_ENV"),
        "{e}"
    );
    // The real search tries every major's soname on the library path.
    for name in ["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"] {
        assert!(SONAMES.contains(&name), "{name}");
    }
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn already_loaded_means_nvrtc_itself_not_its_builtins() {
    let loaded: Vec<String> = [
        "/usr/lib/x86_64-linux-gnu/libc.so.6",
        "/s/nvidia/cu13/lib/libnvrtc-builtins.so.13.2",
        "/s/nvidia/cu13/lib/libnvrtc.so.13",
        "/opt/cuda/lib64/libnvrtc.so",
        "/s/nvidia/cu13/lib/libnvrtc.alt.so.13",
    ]
    .map(String::from)
    .into();
    assert_eq!(
        already_loaded(&loaded).collect::<Vec<_>>(),
        [
            "/s/nvidia/cu13/lib/libnvrtc.so.13",
            "/opt/cuda/lib64/libnvrtc.so"
        ]
    );
}
