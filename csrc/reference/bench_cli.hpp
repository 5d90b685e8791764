// mhakit — command-line pieces shared by the benchmark executables (benchmark_mha_fwd, benchmark_mha_bwd).
//
// Header-only, plain C++17, no CUDA. Follows the CLI conventions of aiter's / CK's fmha benchmarks:
//   * ArgParser: "-key=value" arguments with defaults and help text; "-?" / "-help" / "--help" ask for help; unknown
//     keys are errors; keys aiter knows but mhakit does not implement can be registered as "accepted only at their
//     default" and are rejected by name otherwise;
//   * the arguments both benchmarks share (add_shape_args, add_mask_arg, add_seed_arg, add_timing_args), the value
//     tests of arguments accepted only at their default, and CommonArgs (the shared ones read and checked);
//   * parse_mask: the mask strings 0, 1|t, 2|b, t:l,r, b:l,r, g:y,x, xt:w, xb:w -> mhakit_mask_type + window sizes;
//   * decode_seqlens: -s / -s_k, including per-batch comma lists in group mode, generating missing lengths from the
//     seed around the last given value (the total is kept: lengths move between sequences one unit at a time);
//   * checked_product: element counts computed without overflowing int64 (sizes are checked before allocating);
//   * fill_tensor: the -init methods (forward: ui/0, ni, uf/1, nf, tf/2; backward: 0, 1, 2) into fp16/bf16 host
//     buffers.
#pragma once

#include <stdint.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <utility>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "host_attention.hpp"

namespace mhakit {
namespace bench {

// ------------------------------------------------------------------------------------------------------------------
// Strict number parsing
// ------------------------------------------------------------------------------------------------------------------

inline bool parse_int(const std::string& s, int* out) {
    if (s.empty()) return false;
    errno = 0;
    char* end = nullptr;
    const long v = std::strtol(s.c_str(), &end, 10);
    if (errno != 0 || end == s.c_str() || *end != '\0' || v < -2147483647L - 1 || v > 2147483647L) return false;
    *out = int(v);
    return true;
}

inline bool parse_uint32(const std::string& s, uint32_t* out) {
    if (s.empty() || s[0] == '-') return false;
    errno = 0;
    char* end = nullptr;
    const unsigned long long v = std::strtoull(s.c_str(), &end, 10);
    if (errno != 0 || end == s.c_str() || *end != '\0' || v > 0xFFFFFFFFull) return false;
    *out = uint32_t(v);
    return true;
}

inline bool parse_uint64(const std::string& s, uint64_t* out) {
    if (s.empty() || s[0] == '-') return false;
    errno = 0;
    char* end = nullptr;
    const unsigned long long v = std::strtoull(s.c_str(), &end, 10);
    if (errno != 0 || end == s.c_str() || *end != '\0') return false;
    *out = uint64_t(v);
    return true;
}

inline bool parse_float(const std::string& s, float* out) {
    if (s.empty()) return false;
    errno = 0;
    char* end = nullptr;
    const float v = std::strtof(s.c_str(), &end);
    if (errno != 0 || end == s.c_str() || *end != '\0') return false;
    *out = v;
    return true;
}

inline bool parse_bool(const std::string& s, bool* out) {
    if (s == "1" || s == "true" || s == "t" || s == "y" || s == "yes" || s == "on") {
        *out = true;
        return true;
    }
    if (s == "0" || s == "false" || s == "f" || s == "n" || s == "no" || s == "off") {
        *out = false;
        return true;
    }
    return false;
}

// Splits "a,b,c" into its fields (an empty string gives one empty field).
inline std::vector<std::string> split_commas(const std::string& s) {
    std::vector<std::string> out;
    size_t pos = 0;
    for (;;) {
        const size_t c = s.find(',', pos);
        out.push_back(s.substr(pos, c == std::string::npos ? std::string::npos : c - pos));
        if (c == std::string::npos) break;
        pos = c + 1;
    }
    return out;
}

// ------------------------------------------------------------------------------------------------------------------
// ArgParser
// ------------------------------------------------------------------------------------------------------------------

class ArgParser {
public:
    // A supported argument.
    ArgParser& add(const std::string& name, const std::string& def, const std::string& help) {
        opts_.push_back({name, def, help, def, false, nullptr, std::string()});
        return *this;
    }
    // An argument aiter knows that we do not implement: accepted only when is_default(value) holds; `what` says
    // which values are accepted (e.g. "n or 0").
    ArgParser& add_unsupported(const std::string& name, const std::string& def, const std::string& what,
                               std::function<bool(const std::string&)> is_default) {
        opts_.push_back({name, def, std::string(), def, false, std::move(is_default), what});
        return *this;
    }

    // Text printed at the end of the help (e.g. how the performance numbers are counted); empty: nothing.
    ArgParser& set_epilog(const std::string& text) {
        epilog_ = text;
        return *this;
    }

    // Returns 0 on success, 1 when help was requested (printed to stdout), -1 on error (message in *err).
    int parse(int argc, char** argv, std::string* err) {
        for (int i = 1; i < argc; ++i) {
            const std::string arg = argv[i];
            if (arg == "-?" || arg == "-help" || arg == "--help") {
                print_help(stdout, argc > 0 ? argv[0] : "benchmark");
                return 1;
            }
            if (arg.size() < 2 || arg[0] != '-') {
                *err = "malformed argument '" + arg + "' (expected -key=value; -? lists the arguments)";
                return -1;
            }
            const size_t eq = arg.find('=');
            if (eq == std::string::npos) {
                *err = "argument '" + arg + "' has no value (expected " + arg + "=<value>; -? lists the arguments)";
                return -1;
            }
            const std::string key = arg.substr(1, eq - 1);
            const std::string val = arg.substr(eq + 1);
            Opt* o = find(key);
            if (o == nullptr) {
                *err = "unknown argument -" + key + " (-? lists the arguments)";
                return -1;
            }
            if (o->is_default) {
                if (!o->is_default(val)) {
                    *err = "-" + key + "=" + val + " is not supported by mhakit yet (accepted: -" + key + "=" + o->what +
                           ", the default)";
                    return -1;
                }
            }
            o->value = val;
            o->given = true;
        }
        return 0;
    }

    const std::string& str(const std::string& name) const { return get(name).value; }
    bool given(const std::string& name) const { return get(name).given; }

    bool get_int(const std::string& name, int* out, std::string* err) const {
        if (parse_int(str(name), out)) return true;
        *err = "-" + name + "=" + str(name) + ": expected an integer";
        return false;
    }
    bool get_uint32(const std::string& name, uint32_t* out, std::string* err) const {
        if (parse_uint32(str(name), out)) return true;
        *err = "-" + name + "=" + str(name) + ": expected a non-negative integer";
        return false;
    }
    bool get_float(const std::string& name, float* out, std::string* err) const {
        if (parse_float(str(name), out)) return true;
        *err = "-" + name + "=" + str(name) + ": expected a number";
        return false;
    }
    bool get_bool(const std::string& name, bool* out, std::string* err) const {
        if (parse_bool(str(name), out)) return true;
        *err = "-" + name + "=" + str(name) + ": expected 0 or 1";
        return false;
    }

    void print_help(FILE* f, const char* prog) const {
        std::fprintf(f, "usage: %s [-key=value ...]\nargs:\n", prog);
        for (const auto& o : opts_) {
            if (o.is_default) continue;
            // first help line next to the key, continuation lines indented under it
            const std::vector<std::string> lines = split_lines(o.help);
            for (size_t i = 0; i < lines.size(); ++i) {
                if (i == 0)
                    std::fprintf(f, "%20s  %s%s\n", ("-" + o.name).c_str(), lines[i].c_str(),
                                 lines.size() == 1 ? (" (default:" + o.def + ")").c_str() : "");
                else
                    std::fprintf(f, "%20s  %s%s\n", "", lines[i].c_str(),
                                 i + 1 == lines.size() ? (" (default:" + o.def + ")").c_str() : "");
            }
        }
        bool any = false;
        for (const auto& o : opts_)
            if (o.is_default) {
                if (!any) std::fprintf(f, "accepted only at their default (not supported by mhakit yet):\n");
                any = true;
                std::fprintf(f, "%20s  =%s\n", ("-" + o.name).c_str(), o.what.c_str());
            }
        if (!epilog_.empty()) std::fprintf(f, "%s%s", epilog_.c_str(), epilog_.back() == '\n' ? "" : "\n");
    }

private:
    struct Opt {
        std::string name, def, help, value;
        bool given;
        std::function<bool(const std::string&)> is_default;  // set for unsupported arguments
        std::string what;
    };
    std::vector<Opt> opts_;
    std::string epilog_;

    Opt* find(const std::string& name) {
        for (auto& o : opts_)
            if (o.name == name) return &o;
        return nullptr;
    }
    const Opt& get(const std::string& name) const {
        for (const auto& o : opts_)
            if (o.name == name) return o;
        std::fprintf(stderr, "internal error: argument -%s was never registered\n", name.c_str());
        std::abort();
    }
    static std::vector<std::string> split_lines(const std::string& s) {
        std::vector<std::string> out;
        size_t pos = 0;
        for (;;) {
            const size_t nl = s.find('\n', pos);
            out.push_back(s.substr(pos, nl == std::string::npos ? std::string::npos : nl - pos));
            if (nl == std::string::npos) break;
            pos = nl + 1;
        }
        return out;
    }
};

// ------------------------------------------------------------------------------------------------------------------
// Arguments both benchmarks take, with aiter's names and meanings
// ------------------------------------------------------------------------------------------------------------------

// -mode, -b, -h, -h_k, -s, -s_k, -d, -d_v: the problem's shape.
inline ArgParser& add_shape_args(ArgParser& ap) {
    return ap.add("mode", "0", "kernel mode. 0: batch, 1: group")
        .add("b", "2", "batch size")
        .add("h", "8", "num of head, for q")
        .add("h_k", "-1", "num of head, for k/v, -1 means equal to h\nif not equal to h, then this is GQA/MQA case")
        .add("s", "3328",
             "seqlen_q. if group-mode, means the average value of seqlen_q\n"
             "total_seqlen_q = seqlen_q * batch, and seqlen_q per batch may vary\n"
             "also with \"-s=s0,s1,s2...\" comma separated int to set per batch seqlen (group-mode)")
        .add("s_k", "-1", "seqlen_k, -1 means equal to s\nalso \"-s_k=k0,k1,...\" per batch (group-mode)")
        .add("d", "128", "head dim for q, k")
        .add("d_v", "-1", "head dim for v, -1 means equal to d");
}

// -mask (parse_mask's strings).
inline ArgParser& add_mask_arg(ArgParser& ap) {
    return ap.add("mask", "0",
                  "0: no mask, 1: top-left(same as 't'), 2:bottom-right(same as 'b')\n"
                  "'t', top-left causal mask, 'b', bottom-r causal mask\n"
                  "'t:l,r', top-left sliding window attn(swa) with FA style left right size\n"
                  "'b:l,r', bottom-r sliding window attn(swa) with FA style left right size\n"
                  "'xt:window_size', xformer style masking from top-left, window_size negative is causal, positive is "
                  "swa\n"
                  "'xb:window_size', xformer style masking from bottom-r, window_size negative is causal, positive is "
                  "swa\n"
                  "'g:y,x', generic attention mask coordinate with y/x size (only debug purpose for now)");
}

// -seed (of the inputs).
inline ArgParser& add_seed_arg(ArgParser& ap) {
    return ap.add("seed", "11939", "random seed used for initializing input tensors. 0 for non-deterministic seed");
}

// -warmup, -repeat.
inline ArgParser& add_timing_args(ArgParser& ap) {
    return ap.add("warmup", "10", "number of iterations before benchmark the kernel")
        .add("repeat", "10", "number of iterations to benchmark the kernel");
}

// Value tests for ArgParser::add_unsupported (an argument aiter knows, accepted only at its default).
using ValueTest = std::function<bool(const std::string&)>;
inline ValueTest int_equal_to(int want) {
    return [want](const std::string& s) {
        int v;
        return parse_int(s, &v) && v == want;
    };
}
inline ValueTest int_at_most(int bound) {
    return [bound](const std::string& s) {
        int v;
        return parse_int(s, &v) && v <= bound;
    };
}
inline ValueTest bool_equal_to(bool want) {
    return [want](const std::string& s) {
        bool v;
        return parse_bool(s, &v) && v == want;
    };
}
inline ValueTest one_of(std::vector<std::string> ok) {
    return [ok](const std::string& s) { return std::find(ok.begin(), ok.end(), s) != ok.end(); };
}

// The arguments of add_shape_args plus -v, -kname, -warmup, -repeat and -seed, read and checked (one sentence in
// *err otherwise). h_k < 0 and d_v < 0 are resolved (to h and d); a seed of 0 draws one (said on stderr as `prog`).
struct CommonArgs {
    int do_validation = 0, mode = 0, batch = 0, nhead = 0, nhead_k = 0, hdim_q = 0, hdim_v = 0, kname = 0,
        warmup = 0, repeat = 0;
    uint32_t seed = 0;
    bool group = false;

    bool parse(ArgParser& ap, std::string* err) {
        if (!ap.get_int("v", &do_validation, err) || !ap.get_int("mode", &mode, err) || !ap.get_int("b", &batch, err) ||
            !ap.get_int("h", &nhead, err) || !ap.get_int("h_k", &nhead_k, err) || !ap.get_int("d", &hdim_q, err) ||
            !ap.get_int("d_v", &hdim_v, err) || !ap.get_int("kname", &kname, err) ||
            !ap.get_uint32("seed", &seed, err) || !ap.get_int("warmup", &warmup, err) ||
            !ap.get_int("repeat", &repeat, err))
            return false;
        const auto fail = [err](const std::string& msg) {
            *err = msg;
            return false;
        };
        if (do_validation == 2) return fail("-v=2 (GPU validation) is not supported by mhakit yet; use -v=1 (CPU) or -v=0");
        if (do_validation != 0 && do_validation != 1) return fail("-v must be 0 or 1");
        if (mode != 0 && mode != 1) return fail("-mode must be 0 (batch) or 1 (group)");
        group = (mode == 1);
        if (batch < 1) return fail("-b must be >= 1");
        if (nhead < 1) return fail("-h must be >= 1");
        if (nhead_k < 0) nhead_k = nhead;
        if (nhead_k < 1 || nhead % nhead_k != 0)
            return fail("nhead:" + std::to_string(nhead) + " must be multiple of nhead_k:" + std::to_string(nhead_k));
        if (hdim_v < 0) hdim_v = hdim_q;
        if (hdim_q < 1 || hdim_v < 1) return fail("-d and -d_v must be >= 1");
        if (kname < 0 || warmup < 0 || repeat < 0) return fail("-kname, -warmup and -repeat must be >= 0");
        return true;
    }

    // A seed of 0 becomes a random one, said on stderr.
    void draw_seed(const char* prog) {
        if (seed != 0) return;
        seed = std::random_device{}();
        if (seed == 0) seed = 1;
        std::fprintf(stderr, "%s: -seed=0, using random seed %u\n", prog, seed);
    }
};

// ------------------------------------------------------------------------------------------------------------------
// Mask strings
// ------------------------------------------------------------------------------------------------------------------

struct MaskSpec {
    int type = MHAKIT_MASK_NONE;  // mhakit_mask_type
    int left = -1;                // window_size_left  (generic: y)
    int right = -1;               // window_size_right (generic: x)

    // aiter's / CK's printed form: n, t(l:r), b(l:r), g(y:x)
    std::string str() const {
        switch (type) {
            case MHAKIT_MASK_NONE: return "n";
            case MHAKIT_MASK_TOP_LEFT: return "t(" + std::to_string(left) + ":" + std::to_string(right) + ")";
            case MHAKIT_MASK_BOTTOM_RIGHT: return "b(" + std::to_string(left) + ":" + std::to_string(right) + ")";
            default: return "g(" + std::to_string(left) + ":" + std::to_string(right) + ")";
        }
    }
};

// 0                 no mask
// 1 | t             causal, top-left      (left -1, right 0)
// 2 | b             causal, bottom-right  (left -1, right 0)
// t:l,r | b:l,r     sliding window, FA-style left/right sizes (negative = unbounded on that side)
// xt:w | xb:w       xformers-style window: w > 0 gives left = w/2, right = w-1-left; w <= 0 is causal
// g:y,x             CK's generic coordinate, passed raw (MHAKIT_MASK_GENERIC)
inline bool parse_mask(const std::string& s, MaskSpec* out, std::string* err) {
    MaskSpec m;
    const auto bad = [&](const char* why) {
        *err = "invalid -mask=" + s + ": " + why +
               " (expected 0, 1, 2, t, b, t:l,r, b:l,r, g:y,x, xt:w or xb:w)";
        return false;
    };
    const size_t colon = s.find(':');
    if (colon == std::string::npos) {
        if (s == "0") {
            m.type = MHAKIT_MASK_NONE;
        } else if (s == "1" || s == "t") {
            m.type = MHAKIT_MASK_TOP_LEFT;
            m.left = -1;
            m.right = 0;
        } else if (s == "2" || s == "b") {
            m.type = MHAKIT_MASK_BOTTOM_RIGHT;
            m.left = -1;
            m.right = 0;
        } else {
            return bad("unknown mask");
        }
        *out = m;
        return true;
    }
    const std::string kind = s.substr(0, colon), val = s.substr(colon + 1);
    if (kind == "xt" || kind == "xb") {
        int w;
        if (!parse_int(val, &w)) return bad("the window size must be one integer");
        m.type = kind == "xt" ? MHAKIT_MASK_TOP_LEFT : MHAKIT_MASK_BOTTOM_RIGHT;
        if (w > 0) {
            m.left = w / 2;
            m.right = w - 1 - m.left;
        } else {
            m.left = -1;
            m.right = 0;
        }
        *out = m;
        return true;
    }
    if (kind == "t" || kind == "b" || kind == "g") {
        const std::vector<std::string> f = split_commas(val);
        if (f.size() != 2) return bad(f.size() > 2 ? "sink sizes are not supported; give exactly two integers"
                                                   : "expected two comma-separated integers");
        int v0, v1;
        if (!parse_int(f[0], &v0) || !parse_int(f[1], &v1)) return bad("expected two comma-separated integers");
        m.type = kind == "t" ? MHAKIT_MASK_TOP_LEFT : kind == "b" ? MHAKIT_MASK_BOTTOM_RIGHT : MHAKIT_MASK_GENERIC;
        m.left = v0;
        m.right = v1;
        *out = m;
        return true;
    }
    return bad("unknown mask kind");
}

// ------------------------------------------------------------------------------------------------------------------
// Sequence lengths
// ------------------------------------------------------------------------------------------------------------------

// `count` lengths averaging `avg`: all start at clamp(avg, max(min_len, 1), max_len) (max_len <= 0: unbounded), then,
// in group mode with count > 1, avg·(count/2) random single-unit moves from one sequence to another that keep every
// length within [min, max] (so the total is kept). Deterministic for a given seed.
inline std::vector<int> generate_seqlens(bool group, int count, int avg, int min_len, int max_len, uint32_t seed) {
    if (count <= 0) return {};
    const int lo = min_len > 0 ? min_len : 1;
    const int hi = max_len > 0 ? max_len : 2147483647;
    std::vector<int> v(size_t(count), std::min(std::max(avg, lo), hi));
    if (group && count > 1 && avg > 0) {
        std::mt19937 gen(seed);
        std::uniform_int_distribution<int> pick(0, count - 1), step(1, count - 1);
        for (int64_t rep = int64_t(avg) * (count / 2); rep > 0; --rep) {
            const int dec = pick(gen);
            if (v[size_t(dec)] <= lo) continue;
            const int inc = (dec + step(gen)) % count;
            if (v[size_t(inc)] >= hi) continue;
            --v[size_t(dec)];
            ++v[size_t(inc)];
        }
    }
    return v;
}

// The product of `dims` (each >= 0), or -1 when it does not fit int64.
inline int64_t checked_product(std::initializer_list<int64_t> dims) {
    int64_t p = 1;
    for (int64_t d : dims) {
        if (d < 0 || (d != 0 && p > INT64_MAX / d)) return -1;
        p *= d;
    }
    return p;
}

// The sum of `lens`, or -1 when it does not fit the int32 offsets of group mode (seqstart).
inline int64_t int32_total(const std::vector<int>& lens) {
    int64_t total = 0;
    for (int l : lens) {
        total += l;
        if (total > INT32_MAX) return -1;
    }
    return total;
}

// -s / -s_k as aiter decodes them.
//   batch mode: one value each; s_k < 0 means s_k = s. Every sequence gets these lengths.
//   group mode: "-s=s0,s1,..." and "-s_k=k0,k1,..." per sequence; s_k entries past the end of its list repeat the
//     last one, a negative s_k entry means "same as s" for that sequence. When fewer than `batch` s values are given,
//     the rest are generated around the last given value (and likewise for s_k; when that was "same as s", the
//     generated s_k copy the generated s). Extra values past `batch` are ignored.
inline bool decode_seqlens(bool group, int batch, const std::string& s, const std::string& s_k, uint32_t seed,
                           std::vector<int>* seqlen_q, std::vector<int>* seqlen_k, std::string* err) {
    const std::vector<std::string> fq = split_commas(s), fk = split_commas(s_k);
    std::vector<int> q, k;
    for (const auto& x : fq) {
        int v;
        if (!parse_int(x, &v) || v < 0) {
            *err = "-s=" + s + ": expected non-negative integer(s)";
            return false;
        }
        q.push_back(v);
    }
    for (const auto& x : fk) {
        int v;
        if (!parse_int(x, &v) || v < -1) {
            *err = "-s_k=" + s_k + ": expected integer(s) >= 0, or -1 for \"same as -s\"";
            return false;
        }
        k.push_back(v);
    }
    if (!group) {
        if (q.size() != 1 || k.size() != 1) {
            *err = "per-batch length lists (-s=a,b,...) need group mode (-mode=1)";
            return false;
        }
        seqlen_q->assign(size_t(batch), q[0]);
        seqlen_k->assign(size_t(batch), k[0] < 0 ? q[0] : k[0]);
        return true;
    }
    std::vector<int> sq, sk;
    bool last_k_from_q = false;
    for (size_t i = 0; i < q.size() && int(i) < batch; ++i) {
        const int kv = k[std::min(i, k.size() - 1)];
        sq.push_back(q[i]);
        sk.push_back(kv < 0 ? q[i] : kv);
        last_k_from_q = kv < 0;
    }
    if (int(sq.size()) < batch) {
        const int rem = batch - int(sq.size());
        const std::vector<int> rq = generate_seqlens(true, rem, sq.back(), 1, -1, seed);
        const std::vector<int> rk =
            last_k_from_q ? rq : generate_seqlens(true, rem, sk.back(), 1, -1, seed ^ 0x9E3779B9u);
        sq.insert(sq.end(), rq.begin(), rq.end());
        sk.insert(sk.end(), rk.begin(), rk.end());
    }
    for (const auto& [name, lens] : {std::make_pair("-s", &sq), std::make_pair("-s_k", &sk)})
        if (int32_total(*lens) < 0) {
            *err = std::string(name) + ": the sequences of the batch hold more than 2147483647 tokens in total, " +
                   "beyond the int32 offsets (seqstart) of group mode";
            return false;
        }
    *seqlen_q = sq;
    *seqlen_k = sk;
    return true;
}

// Cumulative offsets of `lens` (callers check int32_total() first: the offsets are int32).
inline std::vector<int32_t> to_seqstarts(const std::vector<int>& lens) {
    std::vector<int32_t> st(1, 0);
    for (int l : lens) st.push_back(st.back() + l);
    return st;
}

// ------------------------------------------------------------------------------------------------------------------
// Input initialisation (-init)
// ------------------------------------------------------------------------------------------------------------------

enum class InitMethod {
    UniformInt,       // forward ui|0: integers in [-3, 3]
    NormalInt,        // ni
    UniformFloat,     // forward uf|1: [0, 1)
    NormalFloat,      // nf
    Trig,             // tf|2
    UniformInt2,      // backward 0: integers in [-2, 2]
    UniformFloatSym,  // backward 1: [-1, 1)
    UniformFloatFp8,  // forward ufq|uf:q|3: [-448, 448), e4m3's full range
};

// ui|0: uniform in [-3, 3] rounded to integers; ni: normal (mean -3, variance 3) rounded to integers;
// uf|1: uniform in [0, 1); nf: normal (mean 0, variance 3); tf|2: cos(linear index); ufq|uf:q|3: uniform in
// [-448, 448), the full range of fp8 e4m3 (aiter's full-range fill for fp8).
inline bool parse_init(const std::string& s, InitMethod* out, std::string* err) {
    if (s == "ui" || s == "0") *out = InitMethod::UniformInt;
    else if (s == "ni") *out = InitMethod::NormalInt;
    else if (s == "uf" || s == "1") *out = InitMethod::UniformFloat;
    else if (s == "nf") *out = InitMethod::NormalFloat;
    else if (s == "tf" || s == "2") *out = InitMethod::Trig;
    else if (s == "ufq" || s == "uf:q" || s == "3") *out = InitMethod::UniformFloatFp8;
    else {
        *err = "invalid -init=" + s + " (expected ui|0, ni, uf|1, nf, tf|2, ufq|3)";
        return false;
    }
    return true;
}

// -init of the backward benchmark, numbered as aiter's benchmark_mha_bwd numbers it: 0 uniform random integers in
// [-2, 2], 1 uniform random floats in [-1, 1), 2 trig (cos of the linear index). The forward's named methods
// (ui, ni, uf, nf, tf) are accepted too, with their forward meaning.
inline bool parse_init_bwd(const std::string& s, InitMethod* out, std::string* err) {
    if (s == "0") *out = InitMethod::UniformInt2;
    else if (s == "1") *out = InitMethod::UniformFloatSym;
    else if (s == "2") *out = InitMethod::Trig;
    else if (s == "ui") *out = InitMethod::UniformInt;
    else if (s == "ni") *out = InitMethod::NormalInt;
    else if (s == "uf") *out = InitMethod::UniformFloat;
    else if (s == "nf") *out = InitMethod::NormalFloat;
    else if (s == "tf") *out = InitMethod::Trig;
    else {
        *err = "invalid -init=" + s + " (expected 0, 1, 2, or one of ui, ni, uf, nf, tf)";
        return false;
    }
    return true;
}

// Calls put(i, value) for i in [0, n), in order, with the values of method m drawn from a generator seeded by seed.
template <class Put>
inline void draw_values(size_t n, InitMethod m, uint32_t seed, Put&& put) {
    std::mt19937 gen(seed);
    auto uniform = [&](float lo, float hi, bool round) {
        std::uniform_real_distribution<float> d(lo, hi);
        for (size_t i = 0; i < n; ++i) put(i, round ? std::round(d(gen)) : d(gen));
    };
    auto normal = [&](float mean, float var, bool round) {
        std::normal_distribution<float> d(mean, std::sqrt(var));
        for (size_t i = 0; i < n; ++i) put(i, round ? std::round(d(gen)) : d(gen));
    };
    switch (m) {
        case InitMethod::UniformInt: uniform(-3.0f, 3.0f, true); break;
        case InitMethod::NormalInt: normal(-3.0f, 3.0f, true); break;
        case InitMethod::UniformFloat: uniform(0.0f, 1.0f, false); break;
        case InitMethod::NormalFloat: normal(0.0f, 3.0f, false); break;
        case InitMethod::UniformInt2: uniform(-2.0f, 2.0f, true); break;
        case InitMethod::UniformFloatSym: uniform(-1.0f, 1.0f, false); break;
        case InitMethod::UniformFloatFp8: uniform(-host::kE4m3Max, host::kE4m3Max, false); break;
        case InitMethod::Trig:
            for (size_t i = 0; i < n; ++i) put(i, float(std::cos(double(i))));
            break;
    }
}

// Fills every element of buf (fp16/bf16 bits) in buffer order.
inline void fill_tensor(std::vector<uint16_t>& buf, InitMethod m, mhakit_dtype dt, uint32_t seed) {
    draw_values(buf.size(), m, seed, [&](size_t i, float v) { buf[i] = host::from_float(v, dt); });
}

// fp8 inputs (-prec=fp8): the values of method m, quantized to e4m3 bytes in buffer order. per_tensor (-qscale=pt):
// divided by the descale factor max|x| / 448 first (1 for an all-zero tensor), which is returned; otherwise stored as
// they are (saturating at ±448) with descale factor 1.
inline float fill_tensor_fp8(std::vector<uint8_t>& buf, InitMethod m, uint32_t seed, bool per_tensor) {
    std::vector<float> x(buf.size());
    draw_values(buf.size(), m, seed, [&](size_t i, float v) { x[i] = v; });
    float amax = 0.0f;
    if (per_tensor)
        for (float v : x) amax = std::max(amax, std::fabs(v));
    const float descale = amax > 0.0f ? amax / host::kE4m3Max : 1.0f;
    for (size_t i = 0; i < x.size(); ++i) buf[i] = host::float_to_e4m3(x[i] / descale);
    return descale;
}

// ------------------------------------------------------------------------------------------------------------------
// Score modifiers: -bias, -logits_soft_cap, -sink (both benchmarks)
// ------------------------------------------------------------------------------------------------------------------

// aiter's -bias: n/0 none; e/1 elementwise ([1,1,s_q,s_k], e:1 [1,h,s_q,s_k], e:2 [b,h,s_q,s_k]); a/2 ALiBi
// (slopes [h], a:1 [b,h]).
struct BiasSpec {
    int type = MHAKIT_BIAS_NONE;  // mhakit_bias_type
    int rank = 0;                 // elementwise: 0, 1 or 2; ALiBi: 0 or 1
    std::string str() const {
        if (type == MHAKIT_BIAS_NONE) return "n";
        return std::string(type == MHAKIT_BIAS_ELEMENTWISE ? "e" : "a") + (rank ? ":" + std::to_string(rank) : "");
    }
};

inline bool parse_bias(const std::string& s, BiasSpec* out, std::string* err) {
    const size_t colon = s.find(':');
    const std::string kind = s.substr(0, colon);
    BiasSpec b;
    if (kind == "n" || kind == "0") b.type = MHAKIT_BIAS_NONE;
    else if (kind == "e" || kind == "1" || kind == "elementwise") b.type = MHAKIT_BIAS_ELEMENTWISE;
    else if (kind == "a" || kind == "2" || kind == "alibi") b.type = MHAKIT_BIAS_ALIBI;
    else return *err = "invalid -bias=" + s + " (n, e[:0|1|2], a[:0|1])", false;
    if (colon != std::string::npos) {
        const int max_rank = b.type == MHAKIT_BIAS_ELEMENTWISE ? 2 : b.type == MHAKIT_BIAS_ALIBI ? 1 : 0;
        if (!parse_int(s.substr(colon + 1), &b.rank) || b.rank < 0 || b.rank > max_rank)
            return *err = "invalid -bias=" + s + " (n, e[:0|1|2], a[:0|1])", false;
    }
    *out = b;
    return true;
}

// -bias, -logits_soft_cap and -sink, registered and read the same way by both benchmarks.
inline void add_score_mod_args(ArgParser& ap) {
    ap.add("bias", "n",
           "n or 0, no bias\n"
           "e(lementwise) or 1, elementwise bias with 1*1*s*s. e:1, 1*h*s*s. e:2, b*h*s*s\n"
           "a(libi) or 2, alibi with 1*h. a:1, b*h")
        .add("logits_soft_cap", "0", "logits soft-cap cap*tanh(s/cap); 0: off")
        .add("sink", "0", "1: a learned sink logit per head added to the softmax denominator (gpt-oss)");
}

// The host side of the modifiers of one benchmark run: values, and the strides of the argument structs.
// Elementwise bias: [b|1, h|1, max_s_q, max_s_k] in the data type (each sequence's block at its batch index, also in
// group mode); ALiBi slopes: 2^(-8(h+1)/nhead) (FlashAttention's), times 1 + b/batch for [b, h]; sink logits: in
// [-1, 2) per query head.
struct ScoreModInputs {
    BiasSpec bias;
    float soft_cap = 0.f;
    bool sink = false;
    std::vector<uint16_t> bias16;   // elementwise
    std::vector<float> slopes;      // ALiBi
    std::vector<float> sinks;       // [nhead]
    int64_t stride_bias = 0, nhead_stride_bias = 0, batch_stride_bias = 0;
    int64_t bias_elems = 0;         // elementwise: the full [b, h, s_q, s_k] of dbias
    int max_sq = 0, max_sk = 0;

    bool any() const { return bias.type != MHAKIT_BIAS_NONE || soft_cap > 0.f || sink; }
    std::string str() const { return bias.str(); }

    void make(int batch, int nhead, int max_seqlen_q, int max_seqlen_k, mhakit_dtype dt, uint32_t seed) {
        max_sq = max_seqlen_q, max_sk = max_seqlen_k;
        std::mt19937 gen(seed ^ 0x5bd1e995u);
        std::uniform_real_distribution<float> u(-1.f, 1.f);
        if (bias.type == MHAKIT_BIAS_ELEMENTWISE) {
            const int64_t plane = int64_t(max_sq) * max_sk;
            const int nb = bias.rank == 2 ? batch : 1, nh = bias.rank >= 1 ? nhead : 1;
            bias16.resize(size_t(int64_t(nb) * nh * plane));
            for (auto& x : bias16) x = mhakit::host::from_float(u(gen), dt);
            stride_bias = max_sk;
            nhead_stride_bias = bias.rank >= 1 ? plane : 0;
            batch_stride_bias = bias.rank == 2 ? int64_t(nh) * plane : 0;
            bias_elems = int64_t(batch) * nhead * plane;
        } else if (bias.type == MHAKIT_BIAS_ALIBI) {
            const int nb = bias.rank == 1 ? batch : 1;
            slopes.resize(size_t(nb) * size_t(nhead));
            for (int b = 0; b < nb; ++b)
                for (int h = 0; h < nhead; ++h)
                    slopes[size_t(b) * nhead + h] = std::pow(2.f, -8.f * float(h + 1) / float(nhead)) * (1.f + float(b) / nb);
            nhead_stride_bias = 1;
            batch_stride_bias = bias.rank == 1 ? nhead : 0;
        }
        if (sink) {
            sinks.resize(size_t(nhead));
            for (auto& x : sinks) x = 0.5f + 1.5f * u(gen);
        }
    }

    // Fills the modifier fields of an argument struct with the given (device or host) pointers.
    template <class Args>
    void fill(Args& a, const void* bias_ptr, const float* sink_ptr) const {
        a.logits_soft_cap = soft_cap;
        a.bias_type = bias.type;
        a.bias_fp32 = bias.type == MHAKIT_BIAS_ALIBI ? 1 : 0;
        a.bias_ptr = bias.type != MHAKIT_BIAS_NONE ? bias_ptr : nullptr;
        a.stride_bias = stride_bias;
        a.nhead_stride_bias = nhead_stride_bias;
        a.batch_stride_bias = batch_stride_bias;
        a.sink_ptr = sink ? sink_ptr : nullptr;
    }
    // The modifiers of the command line (add_score_mod_args); false with *err set on a bad value.
    bool parse(const ArgParser& ap, std::string* err) {
        bool with_sink = false;
        if (!parse_bias(ap.str("bias"), &bias, err) || !ap.get_float("logits_soft_cap", &soft_cap, err) ||
            !ap.get_bool("sink", &with_sink, err))
            return false;
        if (!(soft_cap >= 0.f) || !std::isfinite(soft_cap)) return *err = "-logits_soft_cap must be a number >= 0", false;
        sink = with_sink;
        return true;
    }
    const void* host_bias() const {
        return bias.type == MHAKIT_BIAS_ELEMENTWISE ? static_cast<const void*>(bias16.data())
                                                   : static_cast<const void*>(slopes.data());
    }
    size_t bias_bytes() const { return bias16.size() * 2 + slopes.size() * 4; }
};

// ------------------------------------------------------------------------------------------------------------------
// Dropout: -p_drop, -drop_seed, -drop_offset, -drop_prefs (both benchmarks), -s_randval (forward)
// ------------------------------------------------------------------------------------------------------------------

inline void add_dropout_args(ArgParser& ap, bool with_randval) {
    ap.add("p_drop", "0", "0~1 probability of dropout")
        .add("drop_seed", "1", "seed for the random number generator (Philox4x32-10)")
        .add("drop_offset", "0", "offset for the random number generator")
        .add("drop_prefs", "0", "seed and offset values are present on GPU; 0 - host, 1 - GPU");
    if (with_randval)
        ap.add("s_randval", "0",
               "if 1, store the random bytes of dropout (uint8 [b, h, s_q, s_k]) and validate through them (the\n"
               "stored bytes must equal the host's Philox and feed the host reference)");
}

// The dropout of one benchmark run, and the geometry of its randval tensor: [b, h, s_q, s_k] in batch mode,
// [h, total_q, max_s_k] in group mode (mha_fwd.h).
struct DropoutInputs {
    float p = 0.f;
    uint64_t seed = 1, offset = 0;
    bool prefs = false, store = false;
    int64_t rv_row = 0, rv_head = 0, rv_batch = 0, rv_elems = 0;

    bool on() const { return p > 0.f; }
    bool parse(const ArgParser& ap, bool with_randval, std::string* err) {
        if (!ap.get_float("p_drop", &p, err) || !ap.get_bool("drop_prefs", &prefs, err)) return false;
        if (!parse_uint64(ap.str("drop_seed"), &seed)) return *err = "-drop_seed: expected an integer >= 0", false;
        if (!parse_uint64(ap.str("drop_offset"), &offset)) return *err = "-drop_offset: expected an integer >= 0", false;
        if (!(p >= 0.f && p < 1.f)) return *err = "-p_drop must be in [0, 1)", false;
        if (with_randval && !ap.get_bool("s_randval", &store, err)) return false;
        if (store && !on()) return *err = "-s_randval=1 needs -p_drop > 0", false;
        return true;
    }
    void make(bool group, int64_t shape_batch, int nhead, int64_t shape_sq, int max_sk) {
        rv_row = max_sk;
        rv_head = shape_sq * max_sk;
        rv_batch = group ? 0 : int64_t(nhead) * rv_head;
        rv_elems = shape_batch * nhead * rv_head;
    }
    // The dropout fields of an argument struct (seed / offset from device memory with -drop_prefs=1).
    template <class Args>
    void fill(Args& a, const uint64_t* seed_dev, const uint64_t* offset_dev) const {
        a.p_drop = p;
        a.drop_seed = seed, a.drop_offset = offset;
        a.drop_seed_ptr = prefs ? seed_dev : nullptr;
        a.drop_offset_ptr = prefs ? offset_dev : nullptr;
    }
    std::string str() const {
        std::ostringstream o;
        o << p;
        return o.str();
    }
};

}  // namespace bench
}  // namespace mhakit
