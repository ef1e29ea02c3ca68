//! Paths a user types are relative to the directory the gate was started in, as for every other
//! tool; the gate then works from the project root (producers get root-relative paths), so each
//! such path is resolved once, before the gate changes directory.

use std::path::{Path, PathBuf};

pub struct UserPaths {
    /// The directory the gate was started in.
    cwd: PathBuf,
    /// The project root, canonical.
    root: PathBuf,
}

impl UserPaths {
    pub fn new(cwd: &Path, root: &Path) -> UserPaths {
        let root = std::fs::canonicalize(cwd.join(root)).unwrap_or_else(|_| cwd.join(root));
        UserPaths {
            cwd: cwd.to_path_buf(),
            root,
        }
    }

    /// `p` (relative to where the gate was started) as an absolute path, symlinks resolved as
    /// far as the path exists.
    pub fn absolute(&self, p: &Path) -> PathBuf {
        let abs = self.cwd.join(p);
        if let Ok(c) = std::fs::canonicalize(&abs) {
            return c;
        }
        match (abs.parent().map(std::fs::canonicalize), abs.file_name()) {
            (Some(Ok(parent)), Some(name)) => parent.join(name),
            _ => abs,
        }
    }

    /// `p` as the gate, working in the root, spells it: relative to the root when it lies inside
    /// (so traces record the same paths wherever the checkout lives), else absolute.
    pub fn resolve(&self, p: &Path) -> PathBuf {
        let abs = self.absolute(p);
        match abs.strip_prefix(&self.root) {
            Ok(rel) if rel.as_os_str().is_empty() => PathBuf::from("."),
            Ok(rel) => rel.to_path_buf(),
            Err(_) => abs,
        }
    }
}

/// A path the gate uses (relative to its working directory, the root) as an absolute path, for
/// messages: the user need not know where the gate works from.
pub fn shown(p: &Path) -> String {
    if p.is_absolute() {
        return p.display().to_string();
    }
    match std::env::current_dir() {
        Ok(d) => d
            .join(p.strip_prefix(".").unwrap_or(p))
            .display()
            .to_string(),
        Err(_) => p.display().to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_paths_are_taken_from_where_the_gate_started() {
        let root = tempfile::tempdir().unwrap();
        let root_path = std::fs::canonicalize(root.path()).unwrap();
        std::fs::create_dir_all(root_path.join("sub/fixtures")).unwrap();
        let up = UserPaths::new(&root_path.join("sub"), &root_path);
        // Inside the root: root-relative, spelled from the starting directory.
        assert_eq!(
            up.resolve(Path::new("fixtures")),
            PathBuf::from("sub/fixtures")
        );
        assert_eq!(
            up.resolve(Path::new("../sub/fixtures")),
            PathBuf::from("sub/fixtures")
        );
        assert_eq!(
            up.resolve(Path::new("new.json")),
            PathBuf::from("sub/new.json")
        );
        assert_eq!(up.resolve(Path::new("..")), PathBuf::from("."));
        // Outside the root: absolute.
        let elsewhere = tempfile::tempdir().unwrap();
        let elsewhere = std::fs::canonicalize(elsewhere.path()).unwrap();
        assert_eq!(
            up.resolve(&elsewhere.join("r.json")),
            elsewhere.join("r.json")
        );
        assert_eq!(
            up.absolute(Path::new("r.json")),
            root_path.join("sub/r.json")
        );
    }
}
