//! A child process that can be killed with everything it starts, and dies with its parent.

use std::os::unix::process::CommandExt;

/// Puts the child `cmd` will start in a process group of its own (so the parent can kill the
/// group, and whatever the child left in it), and has the kernel kill it if the parent dies
/// first (PR_SET_PDEATHSIG): in its own group it no longer gets the terminal's Ctrl-C.
pub fn in_own_group(cmd: &mut std::process::Command) {
    cmd.process_group(0);
    // SAFETY: prctl is async-signal-safe; it only asks the kernel to kill the child with us.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
}
