//! The containers backend: one testcontainers container per host, on one Docker network.

use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use testcontainers::core::{IntoContainerPort, Mount, WaitFor};
use testcontainers::runners::AsyncRunner;
use testcontainers::{ContainerAsync, GenericImage, ImageExt};
use tokio::sync::Mutex;

use crate::backend::{Backend, BackendKind};
use crate::host::{Endpoint, Host, HostControl};
use crate::{Error, Result};

/// Label carried by every container the kit starts: the pid of the test process, so a
/// later run can remove what a killed run left behind.
const PID_LABEL: &str = "org.shardline.testkit.pid";

static RUNS: AtomicUsize = AtomicUsize::new(0);

/// Runs each host in its own container from `image`, on a network of its own.
#[derive(Debug)]
pub(crate) struct DockerBackend {
    image: String,
    run: String,
}

impl DockerBackend {
    pub(crate) async fn new(image: String) -> Result<Self> {
        remove_leftovers().await;
        if docker_cli(&["image", "inspect", "--format", "{{.Id}}", &image]).await.is_err() {
            eprintln!("shardline-testkit: image {image} is not present; trying docker pull");
            let pull =
                tokio::time::timeout(Duration::from_secs(300), docker_cli(&["pull", "-q", &image])).await;
            if !matches!(pull, Ok(Ok(_))) {
                return Err(Error::BackendUnavailable {
                    backend: "docker",
                    reason: format!(
                        "image {image} is not present and cannot be pulled; build it from Debian's packages with scripts/pg-image.sh"
                    ),
                });
            }
        }
        let run = format!("shardline-tk-{}-{}", std::process::id(), RUNS.fetch_add(1, Ordering::Relaxed));
        Ok(DockerBackend { image, run })
    }
}

/// Splits `repo[:tag]`, where a `:` inside a registry address is not a tag.
pub(crate) fn split_image(image: &str) -> (&str, &str) {
    match image.rsplit_once(':') {
        Some((repo, tag)) if !tag.contains('/') => (repo, tag),
        _ => (image, "latest"),
    }
}

/// Where the image keeps its cluster (the official image's `PGDATA` too).
const DATA_DIR: &str = "/var/lib/postgresql/data";

#[async_trait]
impl Backend for DockerBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Docker
    }

    async fn start_host(&self, index: usize, settings: &[(String, String)]) -> Result<Host> {
        let name = format!("pg{}", index + 1);
        let container_name = format!("{}-{name}", self.run);
        let port = crate::free_port()?;
        let (repo, tag) = split_image(&self.image);
        let mut cmd = vec!["postgres".to_owned()];
        for (key, value) in settings {
            cmd.push("-c".into());
            cmd.push(format!("{key}={value}"));
        }
        let container = GenericImage::new(repo, tag)
            .with_exposed_port(5432.tcp())
            .with_wait_for(WaitFor::Nothing)
            .with_network(self.run.clone())
            .with_container_name(container_name.clone())
            .with_mapped_port(port, 5432.tcp())
            // The official image needs this to start without a password; ours ignores it.
            .with_env_var("POSTGRES_HOST_AUTH_METHOD", "trust")
            .with_label(PID_LABEL, std::process::id().to_string())
            .with_cmd(cmd)
            // The data directory on a volume of its own, not on the image's layered
            // filesystem: with the fuse-overlayfs storage driver every file Postgres
            // creates (a table, an index) costs a trip through FUSE, which made DDL-heavy
            // work 3x slower. Anonymous: created from the image's baked cluster, kept
            // across stop and start, removed with the container (`rm -v`).
            .with_mount(Mount::volume_mount("", DATA_DIR))
            .start()
            .await
            .map_err(|source| Error::Docker {
                host: name.clone(),
                op: "starting a container",
                source: Box::new(source),
            })?;
        let control = DockerHost {
            name: name.clone(),
            id: container.id().to_owned(),
            container: Mutex::new(Some(container)),
        };
        let host = Host::new(
            name,
            Endpoint { host: "127.0.0.1".into(), port },
            Endpoint { host: container_name, port: 5432 },
            Box::new(control),
        );
        host.wait_ready().await?;
        Ok(host)
    }

    async fn peer_listen_ip(&self) -> Result<String> {
        let gateway =
            docker_cli(&["network", "inspect", "--format", "{{(index .IPAM.Config 0).Gateway}}", &self.run])
                .await?;
        Ok(gateway.trim().to_owned())
    }

    async fn shutdown(&self) -> Result<()> {
        // testcontainers removes the network once its last container is dropped.
        Ok(())
    }
}

#[derive(Debug)]
struct DockerHost {
    name: String,
    id: String,
    container: Mutex<Option<ContainerAsync<GenericImage>>>,
}

impl DockerHost {
    fn docker_err(&self, op: &'static str) -> impl FnOnce(testcontainers::TestcontainersError) -> Error + '_ {
        move |source| Error::Docker { host: self.name.clone(), op, source: Box::new(source) }
    }

    fn gone(&self, op: &'static str) -> Error {
        Error::InvalidState { host: self.name.clone(), op, state: "removed" }
    }
}

#[async_trait]
impl HostControl for DockerHost {
    async fn start(&self) -> Result<()> {
        let guard = self.container.lock().await;
        let c = guard.as_ref().ok_or_else(|| self.gone("start"))?;
        c.start().await.map_err(self.docker_err("starting the container"))
    }

    async fn stop(&self) -> Result<()> {
        let guard = self.container.lock().await;
        let c = guard.as_ref().ok_or_else(|| self.gone("stop"))?;
        // The image's STOPSIGNAL is SIGINT: a fast shutdown; Docker SIGKILLs after 30 s.
        c.stop_with_timeout(Some(30)).await.map_err(self.docker_err("stopping the container"))
    }

    async fn kill(&self) -> Result<()> {
        // Freeze the container first: SIGKILL to PID 1 alone lets the backends see the
        // postmaster die and tell their clients (57P01) before the namespace is torn
        // down; frozen, every process dies without running another instruction. (A host
        // paused already fails to pause again, which is fine.)
        {
            let guard = self.container.lock().await;
            let c = guard.as_ref().ok_or_else(|| self.gone("kill"))?;
            let _ = c.pause().await;
        }
        // `docker kill` signals PID 1 only and then thaws the container, so signal every
        // process of it while it is frozen. `docker top` gives host pids; each is checked
        // to belong to this container's cgroup before it is signalled, so a daemon in
        // another pid namespace makes this a no-op rather than a danger.
        if let Ok(top) = docker_cli(&["top", &self.id, "-o", "pid"]).await {
            for pid in top.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
                let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
                if cgroup.contains(&self.id) {
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(pid),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                }
            }
        }
        // testcontainers has no kill; `docker stop -t 0` would send SIGINT first.
        docker_cli(&["kill", "--signal", "KILL", &self.id]).await.map(drop)
    }

    async fn pause(&self) -> Result<()> {
        let guard = self.container.lock().await;
        let c = guard.as_ref().ok_or_else(|| self.gone("pause"))?;
        // The cgroup freezer gives up ("unable to freeze") when a process does not stop
        // in time, e.g. one in uninterruptible I/O; runc then thaws the container again.
        // So a failed freeze is tried again, at once, a few times: the host is frozen
        // as close to the moment asked for as the kernel allows, or the error stands.
        let mut tries = 0;
        loop {
            tries += 1;
            match c.pause().await {
                Ok(()) => return Ok(()),
                Err(e)
                    if tries < PAUSE_TRIES && crate::host::error_chain(&e).contains("unable to freeze") =>
                {
                    tracing::warn!(host = %self.name, tries, "the cgroup freezer gave up; pausing again");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => return Err(self.docker_err("pausing the container")(e)),
            }
        }
    }

    async fn resume(&self) -> Result<()> {
        let guard = self.container.lock().await;
        let c = guard.as_ref().ok_or_else(|| self.gone("resume"))?;
        c.unpause().await.map_err(self.docker_err("unpausing the container"))
    }

    async fn remove(&self) -> Result<()> {
        let Some(c) = self.container.lock().await.take() else { return Ok(()) };
        // A paused container cannot be removed without force; testcontainers forces.
        c.rm().await.map_err(self.docker_err("removing the container"))
    }

    async fn log_tail(&self) -> String {
        match docker_cli(&["logs", "--tail", "30", &self.id]).await {
            Ok(out) => out,
            Err(e) => format!("(no log: {e})"),
        }
    }
}

/// How many times [`HostControl::pause`] asks the cgroup freezer before it gives up.
const PAUSE_TRIES: u32 = 5;

/// Runs the docker command line; returns stdout and stderr, joined.
async fn docker_cli(args: &[&str]) -> Result<String> {
    let out = tokio::process::Command::new("docker")
        .args(args)
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output()
        .await
        .map_err(|source| Error::Io { what: "running docker", path: "docker".into(), source })?;
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    if out.status.success() {
        Ok(text)
    } else {
        Err(Error::Command {
            program: format!("docker {}", args.first().copied().unwrap_or_default()),
            status: out.status.to_string(),
            stderr: text.trim().to_owned(),
        })
    }
}

/// Removes containers and networks that a test process which no longer exists left
/// behind (it was SIGKILLed before its teardown ran). Best effort.
pub(crate) async fn remove_leftovers() {
    let Ok(listing) = docker_cli(&[
        "ps",
        "-a",
        "--filter",
        &format!("label={PID_LABEL}"),
        "--format",
        &format!("{{{{.ID}}}} {{{{.Label \"{PID_LABEL}\"}}}}"),
    ])
    .await
    else {
        return;
    };
    for line in listing.lines() {
        let mut words = line.split_whitespace();
        let (Some(id), Some(pid)) = (words.next(), words.next()) else { continue };
        if pid.parse::<u32>().is_ok_and(|pid| !crate::pid_alive(pid)) {
            tracing::info!(container = id, pid, "removing a container left by a dead test process");
            let _ = docker_cli(&["rm", "-f", "-v", id]).await;
        }
    }
    if let Ok(networks) = docker_cli(&["network", "ls", "--format", "{{.Name}}"]).await {
        for net in networks.lines().filter_map(|n| n.strip_prefix("shardline-tk-")) {
            let pid = net.split('-').next().and_then(|p| p.parse::<u32>().ok());
            if pid.is_some_and(|pid| !crate::pid_alive(pid)) {
                let _ = docker_cli(&["network", "rm", &format!("shardline-tk-{net}")]).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::split_image;

    #[test]
    fn image_names_split_at_the_tag() {
        assert_eq!(split_image("postgres:15"), ("postgres", "15"));
        assert_eq!(split_image("postgres"), ("postgres", "latest"));
        assert_eq!(split_image("registry.local:5000/pg"), ("registry.local:5000/pg", "latest"));
        assert_eq!(split_image("registry.local:5000/pg:15.4"), ("registry.local:5000/pg", "15.4"));
    }
}
