"""Which of a job's GPUs share an NVLink domain: the launcher's one home for that arithmetic.

A node, for hybrid_ep, is an NVLink domain (hybrid_ep/topology.py): `cluster.nvlink_domain`
GPUs, `cluster.gpus_per_node` on each host (null: the host is the domain). On GB200 NVL72 a
domain is a rack of 18 hosts of 4 GPUs.

How the job's ranks land: srun numbers them host by host in the allocation's node order,
gpus_per_node to a host, and Megatron makes each EP x ETP dispatcher group a run of consecutive
ranks. Where a domain spans hosts the script asks Slurm's block topology for segments
(`#SBATCH --segment=S`): the allocation comes as sets of S hosts, each set inside one block (one
NVLink domain); S x gpus_per_node GPUs are the job's part of a domain (`used` below). Slurm may
put two segments of a job in the same block, and numbers ranks segment by segment only where the
site orders nodes by block (TopologyParam=BlockAsNodeRank, or host names that sort by rack).

The library's rule (decide_domain): a group's members come domain by domain, the same number in
each, at most MAX_DOMAIN_RANKS. So a group either lies inside the job's part of a domain, which
then holds whole groups, or spans whole parts, no two of them in one domain (more than half a
domain each: two segments sharing a block would give that domain twice the group's ranks). A
group within one host needs no NVLink beyond it: no segment. `cluster.segment` null takes the
most hosts of a domain that meet the rule and divide cluster.nodes (Slurm: the node count is a
multiple of the segment); set, it is checked against the rule.
"""

from __future__ import annotations

import dataclasses
import textwrap

from hybrid_ep.topology import MAX_DOMAIN_RANKS, TROUBLESHOOTING
from hybrid_ep.wording import plural

IMEX_CHANNELS = "/dev/nvidia-caps-imex-channels"  # the driver's IMEX channel devices (channel0, ...)


def domain_gpus(recipe) -> int:
    """GPUs of one NVLink domain: cluster.nvlink_domain, else one host's."""
    return recipe["cluster.nvlink_domain"] or recipe["cluster.gpus_per_node"]


def field_problems(recipe) -> list[tuple[str, str]]:
    """cluster.nvlink_domain: whole hosts, at most what the library lays out; cluster.segment:
    hosts of one domain. Checked after gpus_per_node is known to be >= 1."""
    g, given, seg = recipe["cluster.gpus_per_node"], recipe["cluster.nvlink_domain"], recipe["cluster.segment"]
    problems = []
    if given is not None and (given < 1 or given % g):
        problems.append(("cluster.nvlink_domain", f"must be a positive multiple of cluster.gpus_per_node {g} (an "
                                                  f"NVLink domain holds whole hosts), got {given}"))
    elif given is not None and given > MAX_DOMAIN_RANKS:
        problems.append(("cluster.nvlink_domain", f"must be at most {MAX_DOMAIN_RANKS}, the largest NVLink domain "
                                                  f"hybrid_ep lays out (hybrid_ep/topology.py), got {given}"))
    if seg is not None and seg < 1:
        problems.append(("cluster.segment", f"must be >= 1 (hosts of one NVLink domain) or null, got {seg}"))
    elif seg is not None and not problems and seg * g > domain_gpus(recipe):
        problems.append(("cluster.segment", f"{plural(seg, 'host')} of {plural(g, 'GPU')} do not fit in an NVLink "
                                            f"domain of {domain_gpus(recipe)} GPUs ({_where(recipe)})"))
    return problems


def groups_fit(group: int, used: int, domain: int) -> bool:
    """Whether runs of `group` consecutive ranks come domain by domain when each domain holds
    `used` consecutive ranks of the job (the module docstring)."""
    if group <= used:
        return used % group == 0
    return group % used == 0 and 2 * used > domain


def run_fits(ranks: int, used: int) -> bool:
    """Whether a benchmark run on the job's first `ranks` ranks, told its ranks_per_node, comes
    domain by domain: inside the first segment, or whole segments of it (a ranks_per_node given
    may split a domain, so two segments in one domain do not matter there)."""
    return ranks <= used or ranks % used == 0


@dataclasses.dataclass(frozen=True)
class JobDomain:
    """The job's NVLink domains: `segment` hosts of each (None: no segment meets the rule)."""

    domain: int  # GPUs of one NVLink domain
    gpus_per_host: int
    segment: int | None  # hosts of each domain the job's consecutive ranks fill
    given: bool  # segment from cluster.segment (else derived)

    @property
    def used(self) -> int:
        """GPUs of one domain the job fills: the ranks_per_node of a group that spans it."""
        return (self.segment or 1) * self.gpus_per_host

    @property
    def hosts(self) -> int:
        return self.domain // self.gpus_per_host

    @property
    def spans_hosts(self) -> bool:
        """Whether the job asks for segments of several hosts (`#SBATCH --segment`)."""
        return (self.segment or 1) > 1

    def ranks_per_node(self, group: int) -> int:
        """The G the library finds for a group of `group` consecutive ranks (a layout that fits)."""
        return min(group, self.used)


def _segments(domain: int, g: int, nodes: int, fits) -> tuple[list[int], list[int]]:
    """(segments that meet `fits(used GPUs)`, those of them dividing `nodes`), largest first."""
    fit = [s for s in range(domain // g, 0, -1) if fits(s * g)]
    return fit, [s for s in fit if nodes % s == 0]


def pretrain_group(recipe) -> int:
    """Ranks of one dispatcher group: EP x ETP."""
    return recipe["parallelism.ep"] * recipe["parallelism.etp"]


def job_domain(recipe) -> JobDomain:
    """The job's domains: cluster.segment, else the largest segment that fits (module docstring)."""
    g, domain = recipe["cluster.gpus_per_node"], domain_gpus(recipe)
    if recipe["cluster.segment"] is not None:
        return JobDomain(domain, g, recipe["cluster.segment"], True)
    if recipe.kind == "benchmark":
        counts = recipe["bench.node_counts"]
        _, usable = _segments(domain, g, max(counts, default=1),
                              lambda used: all(run_fits(n * g, used) for n in counts))
        return JobDomain(domain, g, usable[0] if usable else 1, False)
    group = pretrain_group(recipe)
    if g % group == 0:  # groups inside one host: no NVLink beyond it is needed
        return JobDomain(domain, g, 1, False)
    _, usable = _segments(domain, g, recipe["cluster.nodes"], lambda used: groups_fit(group, used, domain))
    return JobDomain(domain, g, usable[0] if usable else None, False)


def pretrain_problems(recipe) -> list[tuple[str, str]]:
    """Slurm's rule for a segment given (whole segments), and the hybrid_ep dispatcher's groups on
    the job's domains: refused as the library would refuse them at run time, each naming the
    field to change."""
    job, nodes = job_domain(recipe), recipe["cluster.nodes"]
    problems = []
    if job.given and nodes % job.segment:
        problems.append(("cluster.nodes", f"{nodes} must be a multiple of cluster.segment {job.segment} (Slurm "
                                          "allocates whole segments)"))
    if recipe["dispatcher.type"] == "hybrid_ep":
        problems += _group_problems(recipe, job) + calibration_problems(recipe)
    return problems


def _group_problems(recipe, job: JobDomain) -> list[tuple[str, str]]:
    """The dispatcher's groups of EP x ETP consecutive ranks on the job's domains."""
    group, nodes = pretrain_group(recipe), recipe["cluster.nodes"]
    fit, _ = _segments(job.domain, job.gpus_per_host, nodes, lambda used: groups_fit(group, used, job.domain))
    where = _where(recipe)
    if job.given:
        if groups_fit(group, job.used, job.domain):
            return []
        return [("cluster.segment", f"{plural(job.segment, 'host')} x {job.gpus_per_host} GPUs = {job.used} GPUs of "
                                    f"each NVLink domain ({where}): {_split(group, job)}; hybrid_ep refuses a group "
                                    "whose domains hold different numbers of its ranks (hybrid_ep/topology.py); "
                                    + (f"cluster.segment {' or '.join(map(str, fit))} fits" if fit else
                                       "no segment fits: change parallelism.ep or parallelism.etp"))]
    if job.segment is not None:
        return []
    if job.domain == job.gpus_per_host:  # the host is the domain: the rule as it has always read
        return [("parallelism.ep", f"EP x ETP = {group} ranks per hybrid_ep group must be a multiple or a divisor of "
                                   f"cluster.gpus_per_node {job.gpus_per_host}: a group's ranks on a host share "
                                   "NVLink")]
    if fit:
        return [("cluster.nodes", f"{nodes} must be a multiple of the hosts of each NVLink domain ({where}) that "
                                  f"hold EP x ETP groups of {group} whole: {' or '.join(map(str, fit))} (Slurm "
                                  "allocates whole segments)")]
    return [("parallelism.ep", f"EP x ETP = {group} ranks per hybrid_ep group cannot come domain by domain on NVLink "
                               f"domains of {job.domain} GPUs ({where}) in hosts of {job.gpus_per_host}: hybrid_ep "
                               "needs each group inside one domain, or the same number of its ranks in each")]


def _where(recipe) -> str:
    """The domain's field, as the messages name it."""
    given = recipe["cluster.nvlink_domain"]
    return f"cluster.nvlink_domain {given}" if given else "one host: cluster.nvlink_domain unset"


def group_hosts(recipe) -> tuple[int, int]:
    """(hosts, tasks per host) that run one dispatcher group on hosts of its own (the calibration
    step): whole hosts, or part of one."""
    group, g = pretrain_group(recipe), recipe["cluster.gpus_per_node"]
    tasks = min(group, g)
    return group // tasks, tasks


def calibration_misfit(recipe) -> str | None:
    """Why one dispatcher group cannot run on hosts of its own (the calibration step), or None:
    it must fill whole hosts or divide one."""
    group, g = pretrain_group(recipe), recipe["cluster.gpus_per_node"]
    if group % g and g % group:
        return (f"one EP x ETP group of {group} ranks cannot run on hosts of its own: it must fill whole hosts of "
                f"cluster.gpus_per_node {g} or divide one")
    return None


def calibration_problems(recipe) -> list[tuple[str, str]]:
    """dispatcher.calibrate true where one group cannot run on hosts of its own (null skips it there)."""
    misfit = calibration_misfit(recipe)
    return [("dispatcher.calibrate", misfit)] if recipe["dispatcher.calibrate"] and misfit else []


def _split(group: int, job: JobDomain) -> str:
    """How groups of `group` ranks fall on the job's domains, in words, where they do not fit."""
    if group <= job.used:
        return f"not a whole number of EP x ETP groups of {group}, so a group would straddle two domains"
    if group % job.used:
        return f"an EP x ETP group of {group} is not a whole number of them"
    return (f"an EP x ETP group of {group} spans {group // job.used} segments, and Slurm may place two of them in "
            f"one domain of {job.domain} GPUs, which would then hold twice another's share of the group")


def bench_problems(recipe) -> list[tuple[str, str]]:
    """Each benchmark run on the job's domains (its ranks are the allocation's first)."""
    job, g = job_domain(recipe), recipe["cluster.gpus_per_node"]
    counts = recipe["bench.node_counts"]
    problems = []
    if job.given and max(counts) % job.segment:
        problems.append(("cluster.segment", f"{job.segment} must divide the allocation's "
                                            f"{plural(max(counts), 'node')} (the largest of bench.node_counts)"))
    bad = [n for n in counts if not run_fits(n * g, job.used)]
    if bad:
        problems.append(("bench.node_counts", f"{', '.join(map(str, bad))}: a run of more hosts than a segment takes "
                                              f"whole segments of {plural(job.segment, 'host')} (cluster.segment; "
                                              f"NVLink domains: {_where(recipe)})"))
    return problems


def bench_ranks_per_node(recipe, nodes: int) -> int:
    """--ranks-per-node of the benchmark run on the allocation's first `nodes` hosts."""
    return job_domain(recipe).ranks_per_node(nodes * recipe["cluster.gpus_per_node"])


def needs_fabric(recipe) -> bool:
    """Whether the hybrid_ep dispatcher's domains span hosts: its peers' memory then crosses hosts
    as fabric handles, which need an IMEX channel."""
    job, g = job_domain(recipe), recipe["cluster.gpus_per_node"]
    if recipe.kind == "benchmark":
        return any(bench_ranks_per_node(recipe, n) > g for n in recipe["bench.node_counts"])
    return recipe["dispatcher.type"] == "hybrid_ep" and job.ranks_per_node(pretrain_group(recipe)) > g


def fabric_check() -> str:
    """A task's first commands where hybrid_ep's domains span hosts (bash, inside `bash -c '...'`,
    "$0" the job's interpreter): stop with a line naming the host where the process sees no IMEX
    channel, or its Python has no pynvml, through which hybrid_ep reads the GPU fabric's clique;
    either would leave hybrid_ep with one host per domain, not the job's NVLink domain."""
    host = "${SLURMD_NODENAME:-$HOSTNAME}"
    return (f'compgen -G "{IMEX_CHANNELS}/channel*" >/dev/null || {{ echo "hybrid-ep: {host}: no IMEX channel in '
            f'{IMEX_CHANNELS}, which NVLink domains across hosts need ({TROUBLESHOOTING})" >&2; exit 1; }}; '
            f'"$0" -c "import pynvml" 2>/dev/null || {{ echo "hybrid-ep: {host}: $0 has no pynvml (nvidia-ml-py), '
            f'through which hybrid_ep finds the NVLink domain ({TROUBLESHOOTING})" >&2; exit 1; }}')


def describe(recipe, ranks_per_node: int | None) -> str | None:
    """The dry run's line on the job's domains where they span hosts (None otherwise);
    ranks_per_node: the estimate's, for the hybrid_ep dispatcher (None: another dispatcher)."""
    job = job_domain(recipe)
    if not job.spans_hosts:
        return None
    line = (f"NVLink domains of {job.domain} GPUs ({job.hosts} hosts of {job.gpus_per_host}): the job takes "
            f"{job.segment} hosts ({job.used} GPUs) of each, #SBATCH --segment={job.segment}")
    if ranks_per_node is None:
        return line
    group = pretrain_group(recipe)
    return (line + f"; EP x ETP groups of {group} ranks: ranks_per_node {ranks_per_node}, "
            f"{plural(group // ranks_per_node, 'domain')} each")


def comment_lines(recipe) -> list[str]:
    """The script's header lines on the job's domains (none where the job's domain is one host)."""
    job = job_domain(recipe)
    if not job.spans_hosts:
        return []
    spare = job.hosts - job.segment
    text = [f"NVLink domains (cluster.nvlink_domain): {job.domain} GPUs, {job.hosts} hosts of {job.gpus_per_host}; "
            f"the job takes {job.segment} hosts ({job.used} GPUs) of each domain it uses (#SBATCH "
            f"--segment={job.segment}: cluster.segment{'' if job.given else ', derived'})"
            + (f", {plural(spare, 'host')} of each left to other jobs." if spare else "."),
            "Ranks go host by host in the allocation's node order, so a segment's hosts must come together "
            "(Slurm's TopologyParam=BlockAsNodeRank, or host names sorted by rack); hybrid_ep refuses a group "
            "split unevenly across domains when it starts."]
    if needs_fabric(recipe):
        text.append(f"IMEX: peer memory crosses hosts as fabric handles, which need an IMEX channel ({IMEX_CHANNELS}) "
                    "set up by the site (Slurm's switch/nvidia_imex, or an IMEX prolog); every task first runs "
                    "FABRIC_CHECK: the channel, and pynvml, through which hybrid_ep finds the GPU fabric's clique.")
    wrap = textwrap.TextWrapper(96, subsequent_indent="  ", break_on_hyphens=False)
    return [f"# {line}" for paragraph in text for line in wrap.wrap(paragraph)]


__all__ = ["IMEX_CHANNELS", "JobDomain", "bench_problems", "bench_ranks_per_node", "comment_lines", "describe",
           "domain_gpus", "fabric_check", "field_problems", "groups_fit", "job_domain", "needs_fabric",
           "pretrain_problems", "run_fits"]
