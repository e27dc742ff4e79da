"""`hf-zero3 plan --plot FILE`: the memory of each option as stacked bars of its terms, against the limits.

Why a picture: the table says which option fits; the bars say why (which term takes the room: optimizer
states, activations, the logits) and how far each option is from the GPU's memory and the host's RAM.
"""

from __future__ import annotations

from pathlib import Path

GB = 1e9  # the planner's tables are in GB (10^9 bytes): so is the plot


def gpu_terms(plan) -> list:
    """The GPU terms present at the plan's peak: those held throughout, the peak phase's, and the memory the
    allocator does not see (context, NCCL). Their sum is `plan.gpu_bytes`."""
    return [t for t in plan.terms if t.where == "gpu" and t.bytes > 0
            and (not t.allocator or t.phase in ("always", plan.peak_phase))]


def host_terms(plan) -> list:
    """The host terms of the phase at which the host peaks: start-up (before any offloaded state exists) or the rest."""
    phase = "startup" if plan.host_phase_total("startup") > plan.host_phase_total("always") else "always"
    return [t for t in plan.terms if t.where == "host" and t.bytes > 0 and t.phase == phase]


def plot_plan(path: str | Path, plans: list, title: str) -> bool:
    """Two panels: per GPU and host RAM per node, a stacked bar per option (`plans`, e.g. report.rows(choice)),
    a colour per term, with the GPU memory and the host RAM drawn as limits (and, with --headroom, what a plan may
    use of them). False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    hardware = plans[0].hardware
    names = [p.label + ("" if p.fits else " (does not fit)") for p in plans]
    fig, axes = plt.subplots(1, 2, figsize=(15, 1.2 + 0.55 * len(plans)), sharey=True)
    colours: dict[str, str] = {}
    for ax, terms_of, limit, what in ((axes[0], gpu_terms, hardware.gpu_mem, "memory per GPU (GB)"),
                                      (axes[1], host_terms, hardware.host_ram, "host RAM per node (GB)")):
        for row, plan in enumerate(plans):
            left = 0.0
            for term in terms_of(plan):
                colour = colours.setdefault(term.name, plt.cm.tab20(len(colours) % 20))
                ax.barh(row, term.bytes / GB, left=left, color=colour, edgecolor="white", linewidth=0.5,
                        label=term.name)
                left += term.bytes / GB
        if limit:
            ax.axvline(limit / GB, color="red", linestyle="--", linewidth=1.5,
                       label=f"{'GPU memory' if ax is axes[0] else 'host RAM'}: {limit / GB:.0f} GB")
            if hardware.headroom:  # what a plan may use: the fit is judged against this line, not the one above
                ax.axvline(hardware.usable(limit) / GB, color="darkorange", linestyle=":", linewidth=1.5,
                           label=f"usable with {hardware.headroom:.0%} headroom")
        ax.set_xlabel(what)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(plans)), names)
    axes[0].invert_yaxis()  # cheapest option on top, as in the table
    handles, labels = {}, []
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            if label not in handles:
                handles[label] = handle
                labels.append(label)
    fig.legend([handles[label] for label in labels], labels, loc="lower center", ncol=3, fontsize="small",
               bbox_to_anchor=(0.5, 0))
    fig.suptitle(title)
    rows_of_legend = -(-len(labels) // 3)
    fig.set_size_inches(15, 1.2 + 0.55 * len(plans) + 0.25 * rows_of_legend)
    fig.tight_layout(rect=(0, 0.25 * rows_of_legend / fig.get_size_inches()[1] + 0.02, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
