"""A kernel spec: what an instance computes (its signature) and how (its algorithm), plus its deterministic name."""
from __future__ import annotations

from dataclasses import dataclass

from .catalogue import thaw

# C++ spellings used by the templates.
DTYPE_ENUM = {"fp16": "MHAKIT_DTYPE_FP16", "bf16": "MHAKIT_DTYPE_BF16",
              "fp8bf16": "MHAKIT_DTYPE_FP8_BF16", "fp8fp16": "MHAKIT_DTYPE_FP8_FP16"}


@dataclass(frozen=True)
class Signature:
    """The traits the runtime matches against a call. Runtime properties (GQA, LSE, strides, window sizes) are
    not part of it: every instance serves all of them, so they cost no instances."""

    api: str      # "fwd"
    dtype: str    # "fp16" | "bf16" | "fp8bf16" | "fp8fp16" (e4m3 q/k/v, bf16 / fp16 o: forward, hopper only)
    hdim_q: int   # compiled head-dim bucket of q/k
    hdim_v: int   # compiled head-dim bucket of v/o
    mode: str     # "batch" | "group"
    mask: str     # "nmask" (no mask) | "mask" (any mask kind: causal, windows, generic)
    # The score-modifier kernel (soft-cap, bias / ALiBi, dropout): an instance holds either the plain kernel or this
    # one, never both; "_mods" in the name. Only families whose catalogue score_mods lists `mods` have them.
    mods: bool = False

    @property
    def hdim_token(self) -> str:
        return f"d{self.hdim_q}" if self.hdim_q == self.hdim_v else f"d{self.hdim_q}x{self.hdim_v}"

    @property
    def mask_token(self) -> str:
        """The mask class, with "_mods" after it for a modifier instance (fwd_d128_bf16_batch_mask_mods_...)."""
        return f"{self.mask}_mods" if self.mods else self.mask


# Tile parameters that size a block, in the order they appear in a name after "b" (block_m x block_n x ...): the
# CUDA families use the first two, CK-tile's forward adds its K/N steps and its backward its five GEMM steps.
BLOCK_TOKEN_KEYS = ("block_m", "block_n", "bk0", "bn1", "bk1", "bk0max", "bk2", "bk3", "bk4", "bhdq", "bhdv")


@dataclass(frozen=True)
class Algorithm:
    family: str                          # catalogue family ("hopper", "generic", "qr_async", ...)
    arch: str                            # target arch ("sm_90a", "gfx942")
    tile: tuple[tuple[str, int], ...]    # the family's tile parameters
    variant: tuple[tuple[str, str], ...] = ()  # the family's further axes (catalogue `variants`), one value each
    # A tuning candidate (catalogue `candidate = true`): its name also spells the ring depth (s<stages>, where the
    # family's tiles have one), so that a candidate that differs from the chosen tile only in its stages is named
    # apart from it.
    candidate: bool = False

    @property
    def tile_token(self) -> str:
        values = dict(self.tile)
        token = "b" + "x".join(str(v) for k, v in self.tile if k in BLOCK_TOKEN_KEYS)
        if "warps" in values:
            token += f"w{values['warps']}"
        if "warpgroups" in values:  # decode_tma: wgmma consumers, this many warpgroups
            token += f"g{values['warpgroups']}"
        if values.get("overlap"):  # decode_tma wgmma: the software-pipelined consumer loop (none: no token)
            token += f"o{values['overlap']}"
        if values.get("ctas_per_sm"):  # decode_tma: a cap of CTAs per SM (none: no token)
            token += f"c{values['ctas_per_sm']}"
        # The ring depth: a candidate's (see above), and a persistent tile's cap on its ring (Hopper forward), which
        # runs a different kernel from the one-tile tile of the same block shape beside it.
        if "stages" in values and (self.candidate or values.get("persistent")):
            token += f"s{values['stages']}"
        if values.get("prefetch"):  # decode_tma: blocks prefetched into L2 ahead of the loads (none: no token)
            token += f"p{values['prefetch']}"
        if "l2_promotion" in values:  # decode_tma: the tensor maps' L2 promotion, where the tile names one (else the kernel's)
            token += f"l{values['l2_promotion']}"
        return token


@dataclass(frozen=True)
class Guards:
    """The family's static guards, copied from its catalogue entry: what an instance refuses whatever its run-time
    checks say. The runtime applies them through the generated dispatch table, the JIT when it derives entries."""

    equal_head_dims: bool  # serves only hdim_q == hdim_v
    deterministic: bool    # bwd: serves deterministic calls
    align_bytes: int       # every tensor's base pointer and strides a multiple of this many bytes
    head_dim_multiple: int = 1  # serves only head dims that are multiples of this
    plain_mods: tuple[str, ...] = ()     # the score modifiers its plain instances serve (catalogue score_mods.plain)
    instance_mods: tuple[str, ...] = ()  # those only its modifier instances serve (score_mods.mods; Signature.mods)
    mod_dtypes: tuple[str, ...] | None = None  # the dtypes whose instances serve any of them (score_mods.dtypes; None: all)

    @classmethod
    def of(cls, family) -> "Guards":
        """From a catalogue Family."""
        return cls(family.equal_head_dims, family.deterministic, family.align_bytes, family.head_dim_multiple,
                   family.plain_mods, family.instance_mods, family.mod_dtypes or None)


def mod_bits(names) -> str:
    """A set of score-modifier names as the C expression of their mhakit_score_mod bits ("0" for none)."""
    return " | ".join(f"MHAKIT_MOD_{n.upper()}" for n in names) or "0"


@dataclass(frozen=True)
class KernelSpec:
    signature: Signature
    algorithm: Algorithm
    priority: int
    template: str
    guards: Guards
    # Catalogue data the template reads besides the signature and tile: the family's knobs and the arch's traits
    # (nested (key, value) tuples, as the catalogue stores them). Empty for families that need none.
    knobs: tuple[tuple[str, object], ...] = ()
    # The range of max_seqlen_q (inclusive) in which the runtime prefers this instance over the default tile's
    # instance of the same signature (catalogue `min_seqlen_q` / `max_seqlen_q`); None: it is the default tile's.
    seqlen_q: tuple[int, int] | None = None
    # A modifier instance of a tile with `unmasked_mods` (catalogue): unmasked modifier calls take the unmasked one
    # rather than the masked one, which serves them otherwise (mhakit/jit.py, derive_entry).
    unmasked_mods: bool = False

    @property
    def serves_mods(self) -> tuple[str, ...]:
        """The score modifiers this instance serves: its family's plain ones, and in a modifier instance the rest."""
        g = self.guards
        if g.mod_dtypes is not None and self.signature.dtype not in g.mod_dtypes:
            return ()  # e.g. the Hopper forward's fp8 instances: no modifier, not even a plain one's sink
        return g.plain_mods + g.instance_mods if self.signature.mods else g.plain_mods

    def serves_call_mods(self, names) -> bool:
        """Whether the runtime gives a call that sets these modifiers to this instance (static_guards_hold): it
        serves them all, and a modifier instance only takes calls that the plain one cannot serve."""
        names = set(names)
        if not names <= set(self.serves_mods):
            return False
        return not self.signature.mods or not names <= set(self.guards.plain_mods)

    def admits_head_dims(self, hdim_q: int, hdim_v: int) -> bool:
        """Whether a call's real head dims fit this instance: within the bucket, multiples of the family's
        head_dim_multiple, and equal where the family needs them equal."""
        s, g = self.signature, self.guards
        fits = hdim_q <= s.hdim_q and hdim_v <= s.hdim_v
        multiples = hdim_q % g.head_dim_multiple == 0 and hdim_v % g.head_dim_multiple == 0
        return fits and multiples and (hdim_q == hdim_v or not g.equal_head_dims)

    @property
    def name(self) -> str:
        """Readable and deterministic: fwd_d128_bf16_batch_nmask_sm90a_hopper_b128x128, a modifier instance
        fwd_d128_bf16_batch_mask_mods_sm90a_generic_b128x64w4 (variant values, when the family has any, follow the
        tile: ..._gfx942_qr_async_b128x128x32x128x32x128_psddv_lse)."""
        s, a = self.signature, self.algorithm
        arch = a.arch.replace("_", "")
        name = f"{s.api}_{s.hdim_token}_{s.dtype}_{s.mode}_{s.mask_token}_{arch}_{a.family}_{a.tile_token}"
        return "_".join([name, *(value for _, value in a.variant)])

    def template_context(self) -> dict:
        s, a = self.signature, self.algorithm
        fp8 = s.dtype.startswith("fp8")
        return {
            "name": self.name,
            "api": s.api,
            "Api": s.api.capitalize(),
            "dtype": s.dtype,
            "dtype_enum": DTYPE_ENUM[s.dtype],
            "hdim_q": s.hdim_q,
            "hdim_v": s.hdim_v,
            "group_mode": "true" if s.mode == "group" else "false",
            "masked": "true" if s.mask == "mask" else "false",
            "mods": "true" if s.mods else "false",
            "family": a.family,
            "arch": a.arch,
            "tile": dict(a.tile),
            "variant": dict(a.variant),
            "knobs": thaw(self.knobs),
            "priority": self.priority,
            "equal_head_dims": "true" if self.guards.equal_head_dims else "false",
            "deterministic": "true" if self.guards.deterministic else "false",
            "align_bytes": self.guards.align_bytes,
            "head_dim_multiple": self.guards.head_dim_multiple,
            "mod_kinds": mod_bits(self.serves_mods),
            "plain_mod_kinds": mod_bits(self.guards.plain_mods),
            # (0, 0): the default tile (registry.h, KernelInstance::seqlen_q_min / seqlen_q_max)
            "seqlen_q_min": self.seqlen_q[0] if self.seqlen_q else 0,
            "seqlen_q_max": self.seqlen_q[1] if self.seqlen_q else 0,
            "persistent": "true" if self.persistent else "false",
            # an entry point that says how much workspace a call needs: the backward's; the forward's fp8 (V
            # transposed) and persistent (the tile counter) instances
            "workspace": "true" if s.api == "bwd" or fp8 or self.persistent else "false",
            # the workspace is wanted, not needed: a persistent 16-bit instance's tile counter (fp8 needs V
            # transposed in it whatever the grid)
            "workspace_optional": "true" if self.persistent and not fp8 else "false",
            # split-KV: packed rows per kv head from which the runtime prefers this instance (0: no preference)
            "min_rows": int(dict(a.tile).get("min_rows", 0)),
        }

    @property
    def persistent(self) -> bool:
        """The tile's `persistent` knob (catalogue), which the Hopper forward's batch-mode plain instances take: a
        persistent grid with a dynamic tile counter in the caller's workspace (fmha_fwd_hopper.cuh); group mode and
        "_mods" instances of the tile keep one CTA per tile."""
        s = self.signature
        return (bool(dict(self.algorithm.tile).get("persistent")) and s.api == "fwd" and s.mode == "batch"
                and not s.mods)
