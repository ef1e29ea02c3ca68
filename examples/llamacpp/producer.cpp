// llamacpp-producer: llama.cpp as a tracegate producer (docs/producers.md, "The two verbs").
//
// Runs a GGUF model through llama.cpp's own graph and reads the capture points out of it with
// the scheduler's eval callback (llama_context_params.cb_eval), then writes them through the C
// ABI (capi/include/tracegate.h). The ggml-name -> capture-point mapping is `points_of_layer`
// and README.md's table. Build and run: README.md.
//
//   llamacpp-producer trace --model FILE.gguf|DIR --tokens IDS --out PATH
//                     --capture default|internals [--generate N --cache on|off]
//                     [--threads T] [--plant-mlp L[:S]] [--list-names]
//
// `layer` and `--force-decisions` are refused (exit 2, one line): llama.cpp builds whole
// forwards, not one layer on a given input.

#include "ggml-backend.h"
#include "ggml.h"
#include "llama.h"
#include "tracegate.h"

#include <dirent.h>
#include <sys/stat.h>

#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

namespace {

tg_writer *g_open = nullptr;  // aborted on an error, so no temporary file is left behind

[[noreturn]] void die(const char *fmt, ...) {
    tg_abort(g_open);
    va_list ap;
    va_start(ap, fmt);
    std::fputs("llamacpp-producer: ", stderr);
    std::vfprintf(stderr, fmt, ap);
    std::fputc('\n', stderr);
    va_end(ap);
    std::exit(2);
}

// One captured tensor, widened to f32 and made contiguous; ne as ggml has it (ne[0] fastest).
struct Tensor {
    std::vector<float> data;
    int64_t ne[4] = {1, 1, 1, 1};
};

struct Capture {
    bool internals = false;
    bool list_names = false;
    int plant_mlp = -1;                  // the layer whose ffn_out is perturbed in the graph
    float plant_scale = 1.05f;           // and by what factor
    std::map<std::string, Tensor> seen;  // ggml name -> its last occurrence in the graph
};

bool wanted(const std::string &name, bool internals) {
    static const char *always[] = {"embd", "attn_out-", "ffn_out-", "l_out-", "result_norm"};
    static const char *inner[] = {"Qcur-", "Kcur-", "Vcur-", "kq_soft_max-"};
    // "NAME-<layer>" exactly: not the views ggml names "Qcur-0 (view)" and the like.
    auto starts = [&](const char *p) {
        size_t n = std::strlen(p);
        if (p[n - 1] != '-') return name == p;
        return name.size() > n && name.compare(0, n, p) == 0 &&
               name.find_first_not_of("0123456789", n) == std::string::npos;
    };
    for (const char *p : always)
        if (starts(p)) return true;
    if (internals)
        for (const char *p : inner)
            if (starts(p)) return true;
    return false;
}

// The scheduler asks (ask=true) about every node; for the ones we want it then calls again
// (ask=false) once the node is computed. A name seen again overwrites: several ggml nodes share
// `Qcur-N` (projection, reshape, RoPE) and the last is the RoPE'd one the cache receives.
bool eval_cb(struct ggml_tensor *t, bool ask, void *user) {
    auto *cap = static_cast<Capture *>(user);
    std::string name = ggml_get_name(t);
    if (ask) return cap->list_names || wanted(name, cap->internals);
    if (cap->list_names)
        std::fprintf(stderr, "%-24s %-10s %-5s [%lld, %lld, %lld, %lld]\n", name.c_str(),
                     ggml_op_desc(t), ggml_type_name(t->type), (long long)t->ne[0],
                     (long long)t->ne[1], (long long)t->ne[2], (long long)t->ne[3]);
    if (!wanted(name, cap->internals)) return true;
    if (t->type != GGML_TYPE_F32 && t->type != GGML_TYPE_F16)
        die("ggml tensor %s has type %s; only f32 and f16 are read", name.c_str(),
            ggml_type_name(t->type));
    std::vector<uint8_t> raw(ggml_nbytes(t));
    ggml_backend_tensor_get(t, raw.data(), 0, raw.size());
    Tensor out;
    for (int d = 0; d < 4; d++) out.ne[d] = t->ne[d];
    out.data.resize(size_t(t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3]));
    size_t k = 0;  // gather through the strides: a view need not be contiguous
    for (int64_t i3 = 0; i3 < t->ne[3]; i3++)
        for (int64_t i2 = 0; i2 < t->ne[2]; i2++)
            for (int64_t i1 = 0; i1 < t->ne[1]; i1++)
                for (int64_t i0 = 0; i0 < t->ne[0]; i0++) {
                    size_t off = i0 * t->nb[0] + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3];
                    if (t->type == GGML_TYPE_F32) {
                        std::memcpy(&out.data[k++], &raw[off], 4);
                    } else {
                        ggml_fp16_t h;
                        std::memcpy(&h, &raw[off], 2);
                        out.data[k++] = ggml_fp16_to_fp32(h);
                    }
                }
    // The negative control: a defect *in the forward* (written back, so every later layer
    // computes from it), not only in what is recorded.
    if (cap->plant_mlp >= 0 && name == "ffn_out-" + std::to_string(cap->plant_mlp)) {
        if (t->type != GGML_TYPE_F32 || !ggml_is_contiguous(t))
            die("--plant-mlp: %s is not a contiguous f32 tensor", name.c_str());
        for (float &x : out.data) x *= cap->plant_scale;
        ggml_backend_tensor_set(t, out.data.data(), 0, out.data.size() * 4);
    }
    cap->seen[name] = std::move(out);
    return true;
}

struct Args {
    std::string verb, model, out, capture = "default", cache = "on";
    std::vector<llama_token> tokens;
    int generate = 0, threads = 2, plant_mlp = -1;
    float plant_scale = 1.05f;
    bool list_names = false;
};

long parse_int(const std::string &s, const char *flag, long lo, long hi) {
    if (s.empty() || s.size() > 10 || s.find_first_not_of("0123456789") != std::string::npos)
        die("%s: '%s' is not a non-negative integer", flag, s.c_str());
    long v = std::atol(s.c_str());
    if (v < lo || v > hi) die("%s: %ld is outside [%ld, %ld]", flag, v, lo, hi);
    return v;
}

Args parse(int argc, char **argv) {
    if (argc < 2) die("usage: llamacpp-producer trace --model FILE.gguf --tokens IDS --out PATH ...");
    Args a;
    a.verb = argv[1];
    if (a.verb != "trace")
        die("verb '%s' is not implemented: only 'trace' (llama.cpp runs whole forwards, not one "
            "layer on a given input, so 'layer' cannot be answered)", a.verb.c_str());
    for (int i = 2; i < argc; i++) {
        std::string f = argv[i];
        if (f == "--list-names") { a.list_names = true; continue; }
        if (i + 1 >= argc) die("%s needs a value", f.c_str());
        std::string v = argv[++i];
        if (f == "--model") a.model = v;
        else if (f == "--out") a.out = v;
        else if (f == "--capture") a.capture = v;
        else if (f == "--cache") a.cache = v;
        else if (f == "--generate") a.generate = int(parse_int(v, "--generate", 0, 1 << 20));
        else if (f == "--threads") a.threads = int(parse_int(v, "--threads", 1, 1024));
        else if (f == "--plant-mlp") {
            // L, or L:S for a scale other than 1.05
            size_t c = v.find(':');
            a.plant_mlp = int(parse_int(v.substr(0, c), "--plant-mlp", 0, 1 << 20));
            if (c != std::string::npos) {
                std::string sc = v.substr(c + 1);
                char *end = nullptr;
                a.plant_scale = std::strtof(sc.c_str(), &end);
                if (sc.empty() || *end != '\0' || !std::isfinite(a.plant_scale))
                    die("--plant-mlp: scale '%s' is not a finite number (L or L:S)", sc.c_str());
            }
        }
        else if (f == "--tokens") {
            // The protocol's grammar: ASCII integers separated by single commas.
            size_t p = 0;
            while (true) {
                size_t c = v.find(',', p);
                std::string id = v.substr(p, c == std::string::npos ? c : c - p);
                a.tokens.push_back(llama_token(parse_int(id, "--tokens", 0, INT32_MAX)));
                if (c == std::string::npos) break;
                p = c + 1;
            }
        } else if (f == "--force-decisions")
            die("--force-decisions is not implemented (optional in the protocol)");
        else die("unknown argument %s", f.c_str());
    }
    if (a.model.empty() || a.out.empty() || a.tokens.empty())
        die("trace needs --model, --tokens and --out");
    if (a.capture != "default" && a.capture != "internals")
        die("--capture: '%s' is neither default nor internals", a.capture.c_str());
    if (a.cache != "on" && a.cache != "off") die("--cache: '%s' is neither on nor off", a.cache.c_str());
    return a;
}

// `--model` is a .gguf file, or a directory holding exactly one (the engine's rule).
std::string gguf_path(const std::string &model) {
    struct stat st;
    if (stat(model.c_str(), &st) != 0) die("--model %s: no such file or directory", model.c_str());
    if (!S_ISDIR(st.st_mode)) return model;
    std::vector<std::string> found;
    if (DIR *d = opendir(model.c_str())) {
        while (dirent *e = readdir(d)) {
            std::string n = e->d_name;
            if (n.size() > 5 && n.compare(n.size() - 5, 5, ".gguf") == 0) found.push_back(n);
        }
        closedir(d);
    }
    if (found.size() != 1)
        die("--model %s: holds %zu .gguf files; give one file", model.c_str(), found.size());
    return model + "/" + found[0];
}

std::string json_str(const std::string &s) {
    std::string o = "\"";
    for (unsigned char c : s) {
        if (c == '"' || c == '\\') o += '\\', o += char(c);
        else if (c < 0x20) { char b[8]; std::snprintf(b, sizeof b, "\\u%04x", c); o += b; }
        else o += char(c);
    }
    return o + "\"";
}

struct Writer {
    tg_writer *w;
    void tensor(const std::string &name, const std::vector<uint64_t> &shape, const float *data,
                const std::vector<int64_t> &positions, const char *path) {
        size_t n = 1;
        for (uint64_t d : shape) n *= d;
        tg_attrs at = {path, "causal", positions.data(), positions.size(), nullptr, nullptr, nullptr, 0};
        if (tg_tensor(w, name.c_str(), TG_F32, shape.data(), shape.size(), data, n * 4, &at) != TG_OK)
            die("writing %s: %s", name.c_str(), tg_last_error());
    }
};

// Index of the largest logit (ties: lowest index) and top-1 minus top-2 (docs/capture-points.md).
std::pair<int64_t, float> argmax(const float *row, int n, const std::string &what) {
    int best = -1, second = -1;
    for (int i = 0; i < n; i++) {
        if (std::isnan(row[i])) die("%s: NaN logit at index %d", what.c_str(), i);
        if (best < 0 || row[i] > row[best]) second = best, best = i;
        else if (second < 0 || row[i] > row[second]) second = i;
    }
    return {best, row[best] - row[second]};
}

const Tensor &get(const Capture &cap, const std::string &name) {
    auto it = cap.seen.find(name);
    if (it == cap.seen.end())
        die("llama.cpp's graph had no tensor named %s (run with --list-names to see its names)",
            name.c_str());
    return it->second;
}

// Rows r0.. of a [features, rows] ggml tensor (features = ne0, so each row is contiguous).
std::vector<float> rows_of(const Tensor &t, int64_t r0, int64_t nr, const std::string &name) {
    int64_t rows = t.ne[1] * t.ne[2] * t.ne[3];
    if (r0 + nr > rows) die("%s has %lld rows, %lld wanted", name.c_str(), (long long)rows, (long long)(r0 + nr));
    return std::vector<float>(t.data.begin() + r0 * t.ne[0], t.data.begin() + (r0 + nr) * t.ne[0]);
}

// Qcur/Kcur are [head_dim, heads, tokens] in the GGUF's row order: llama.cpp's converter
// permutes each head's q/k rows so that RoPE rotates adjacent pairs (2i, 2i+1); Hugging Face's
// rotate-half pairs (i, i + d/2). Element 2i+h of a head is HF element h*d/2 + i.
std::vector<float> unpermute_heads(const Tensor &t) {
    int64_t d = t.ne[0], heads = t.ne[1] * t.ne[2] * t.ne[3];
    std::vector<float> o(t.data.size());
    for (int64_t r = 0; r < heads; r++)
        for (int64_t i = 0; i < d / 2; i++)
            for (int64_t h = 0; h < 2; h++) o[r * d + h * d / 2 + i] = t.data[r * d + 2 * i + h];
    return o;
}

std::string lname(int l) {
    char b[32];
    std::snprintf(b, sizeof b, "layer.%02d.", l);
    return b;
}

void silent_log(enum ggml_log_level level, const char *text, void *) {
    if (level == GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
}

}  // namespace

int main(int argc, char **argv) {
    Args a = parse(argc, argv);
    std::string file = gguf_path(a.model);
    char weights[33];
    if (tg_weights_digest(file.c_str(), weights, sizeof weights) != TG_OK)
        die("weights digest of %s: %s", file.c_str(), tg_last_error());

    llama_log_set(silent_log, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model *model = llama_model_load_from_file(file.c_str(), mp);
    if (!model) die("llama.cpp could not load %s", file.c_str());
    const int n_layer = llama_model_n_layer(model);
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    const int n_embd = llama_model_n_embd(model);
    char arch[64] = "";
    if (llama_model_meta_val_str(model, "general.architecture", arch, sizeof arch) < 0 ||
        std::strcmp(arch, "llama") != 0)
        die("%s: architecture '%s'; this example maps the llama graph's names only", file.c_str(), arch);
    for (llama_token t : a.tokens)
        if (t >= n_vocab) die("--tokens: id %d is outside the vocabulary [0, %d)", t, n_vocab);
    if (a.plant_mlp >= n_layer) die("--plant-mlp %d: the model has %d layers", a.plant_mlp, n_layer);

    const int n = int(a.tokens.size());
    const int total = n + a.generate;
    Capture cap;
    cap.internals = a.capture == "internals";
    cap.list_names = a.list_names;
    cap.plant_mlp = a.plant_mlp;
    cap.plant_scale = a.plant_scale;

    llama_context_params cp = llama_context_default_params();
    // One ubatch for the whole prompt, so each ggml name is one graph's, holding every row.
    cp.n_ctx = cp.n_batch = cp.n_ubatch = uint32_t(total < 64 ? 64 : total);
    cp.n_seq_max = 1;
    cp.n_threads = cp.n_threads_batch = a.threads;
    // f32 KV cache and no flash attention: the defaults (f16 cache, flash attention where the
    // backend has it) round k/v to f16 and fuse softmax away (no kq_soft_max to read).
    cp.type_k = cp.type_v = GGML_TYPE_F32;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.cb_eval = eval_cb;
    cp.cb_eval_user_data = &cap;
    cp.no_perf = true;
    llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) die("llama.cpp could not create a context for %s", file.c_str());

    // What its matmuls compute in (docs/producers.md, "Provenance a producer must record"): the
    // CPU path rounds a matmul's f32 input to the weight's vec_dot type, f16 or bf16 for such
    // weights and 8 bits for every quantized type; only all-f32 weights keep f32.
    const llama_ftype ftype = llama_model_ftype(model);
    const char *precision = ftype == LLAMA_FTYPE_ALL_F32      ? "f32"
                            : ftype == LLAMA_FTYPE_MOSTLY_F16  ? "f16"
                            : ftype == LLAMA_FTYPE_MOSTLY_BF16 ? "bf16"
                                                               : "q8";
    std::string prov = "{\"producer\": \"llamacpp-example\", \"dtype\": \"f32\", \"device\": \"cpu\"";
    prov += ", \"precision\": " + json_str(precision);
    prov += ", \"verb\": \"trace\", \"weights_digest\": " + json_str(weights);
    prov += ", \"model_dir\": " + json_str(a.model) + ", \"capture\": " + json_str(a.capture);
    prov += ", \"prompt_tokens\": [";
    for (int i = 0; i < n; i++) prov += (i ? ", " : "") + std::to_string(a.tokens[i]);
    prov += "], \"generate\": " + std::to_string(a.generate) + ", \"cache\": " + json_str(a.cache);
    prov += ", \"seed\": null, \"threads\": " + std::to_string(a.threads);
    prov += ", \"llama_cpp\": {\"package\": \"llama-cpp-python==0.3.36\", \"system_info\": " +
            json_str(llama_print_system_info()) +
            ", \"type_k\": \"f32\", \"type_v\": \"f32\", \"flash_attn\": false}";
    if (a.plant_mlp >= 0)
        prov += ", \"planted\": " + json_str("ffn_out-" + std::to_string(a.plant_mlp) + " x" + std::to_string(a.plant_scale));
    prov += "}";
    Writer w{tg_open(a.out.c_str(), prov.c_str())};
    if (!w.w) die("%s", tg_last_error());
    g_open = w.w;

    // ---- prefill: every prompt row, logits for each (our `logits` holds all n rows)
    llama_batch batch = llama_batch_init(total, 0, 1);
    auto run = [&](const std::vector<llama_token> &toks, int pos0, bool all_logits) {
        cap.seen.clear();
        batch.n_tokens = int(toks.size());
        for (int i = 0; i < batch.n_tokens; i++) {
            batch.token[i] = toks[i];
            batch.pos[i] = pos0 + i;
            batch.n_seq_id[i] = 1;
            batch.seq_id[i][0] = 0;
            batch.logits[i] = all_logits || i + 1 == batch.n_tokens;
        }
        int rc = llama_decode(ctx, batch);
        if (rc != 0) die("llama_decode of %d tokens at position %d returned %d", batch.n_tokens, pos0, rc);
    };
    run(a.tokens, 0, true);

    std::vector<int64_t> pos(n);
    for (int i = 0; i < n; i++) pos[i] = i;
    const uint64_t N = uint64_t(n), H = uint64_t(n_embd);
    auto row_tensor = [&](const std::string &ours, const std::string &ggml, int64_t r0, int64_t nr,
                          const std::vector<int64_t> &p, const char *path) {
        const Tensor &t = get(cap, ggml);
        if (t.ne[0] != n_embd) die("%s has ne0 %lld, not n_embd %d", ggml.c_str(), (long long)t.ne[0], n_embd);
        std::vector<float> v = rows_of(t, r0, nr, ggml);
        w.tensor(ours, {uint64_t(nr), H}, v.data(), p, path);
    };
    row_tensor("embed.out", "embd", 0, n, pos, "prefill");
    for (int l = 0; l < n_layer; l++) {
        std::string L = lname(l), s = "-" + std::to_string(l);
        row_tensor(L + "hidden_in", l == 0 ? "embd" : "l_out-" + std::to_string(l - 1), 0, n, pos, "prefill");
        if (cap.internals) {
            for (const char *qk : {"q", "k", "v"}) {
                std::string g = std::string(qk[0] == 'q' ? "Qcur" : qk[0] == 'k' ? "Kcur" : "Vcur") + s;
                const Tensor &t = get(cap, g);
                if (t.ne[2] != n) die("%s has %lld rows, not %d", g.c_str(), (long long)t.ne[2], n);
                std::vector<float> v = qk[0] == 'v' ? t.data : unpermute_heads(t);
                w.tensor(L + qk, {N, uint64_t(t.ne[1]), uint64_t(t.ne[0])}, v.data(), pos, "prefill");
            }
            // [n_kv, rows, heads]: row-major this is our head-major [heads, rows, keys] once the
            // key axis is cut to the cells this call filled (a fresh cache: cells 0..n-1; the
            // rest are masked, exactly 0).
            const Tensor &p = get(cap, "kq_soft_max" + s);
            if (p.ne[0] < n || p.ne[1] != n)
                die("kq_soft_max%s is [%lld, %lld, ...], not [>= %d, %d, heads]", s.c_str(),
                    (long long)p.ne[0], (long long)p.ne[1], n, n);
            int64_t heads = p.ne[2] * p.ne[3];
            std::vector<float> probs(size_t(heads) * N * N);
            for (int64_t hr = 0; hr < heads * n; hr++)
                for (int64_t k = 0; k < p.ne[0]; k++) {
                    float x = p.data[hr * p.ne[0] + k];
                    if (k < n) probs[hr * n + k] = x;
                    else if (x != 0.0f) die("kq_soft_max%s: key cell %lld beyond the prompt has probability %g", s.c_str(), (long long)k, x);
                }
            w.tensor(L + "attn_probs", {uint64_t(heads), N, N}, probs.data(), pos, "prefill");
        }
        row_tensor(L + "attn_out", "attn_out" + s, 0, n, pos, "prefill");
        row_tensor(L + "mlp_out", "ffn_out" + s, 0, n, pos, "prefill");
        row_tensor(L + "hidden_out", "l_out" + s, 0, n, pos, "prefill");
    }
    row_tensor("final_norm.out", "result_norm", 0, n, pos, "prefill");
    std::vector<float> logits(size_t(n) * n_vocab);
    std::vector<int64_t> am(n);
    std::vector<float> margins(n);
    for (int i = 0; i < n; i++) {
        const float *row = llama_get_logits_ith(ctx, i);
        if (!row) die("llama_get_logits_ith(%d) returned NULL", i);
        std::memcpy(&logits[size_t(i) * n_vocab], row, size_t(n_vocab) * 4);
        auto [tok, m] = argmax(row, n_vocab, "logits row " + std::to_string(i));
        am[i] = tok, margins[i] = m;
    }
    w.tensor("logits", {N, uint64_t(n_vocab)}, logits.data(), pos, "prefill");

    // ---- greedy decode: step 0 decides from the prompt's last row; step s >= 1 runs token
    // s-1 at position n+s-1, alone on the KV cache (--cache on) or as the last row of the whole
    // sequence recomputed from an empty cache (--cache off).
    std::vector<llama_token> seq = a.tokens;
    std::vector<int64_t> step_tok;
    std::vector<float> step_margin;
    const float *last = &logits[size_t(n - 1) * n_vocab];
    for (int s = 0; s < a.generate; s++) {
        char pre[32];
        std::snprintf(pre, sizeof pre, "decode.%04d.", s);
        std::vector<int64_t> p = {s == 0 ? n - 1 : n + s - 1};
        std::vector<float> row;
        if (s == 0) {
            row.assign(last, last + n_vocab);
        } else {
            if (a.cache == "on") {
                run({seq.back()}, n + s - 1, false);
            } else {
                llama_memory_clear(llama_get_memory(ctx), true);
                run(seq, 0, false);
            }
            if (cap.internals) {
                for (int l = 0; l < n_layer; l++) {
                    std::string L = std::string(pre) + lname(l), sfx = "-" + std::to_string(l);
                    // The step's row is the last of each tensor (the last layer may have been cut
                    // to the output rows already).
                    auto last_row = [&](const std::string &ours, const std::string &g) {
                        int64_t r = int64_t(get(cap, g).ne[1]);
                        row_tensor(L + ours, g, r - 1, 1, p, "decode");
                    };
                    last_row("hidden_in", l == 0 ? "embd" : "l_out-" + std::to_string(l - 1));
                    last_row("attn_out", "attn_out" + sfx);
                    last_row("mlp_out", "ffn_out" + sfx);
                    last_row("hidden_out", "l_out" + sfx);
                }
                int64_t r = int64_t(get(cap, "result_norm").ne[1]);
                row_tensor(std::string(pre) + "final_norm.out", "result_norm", r - 1, 1, p, "decode");
            }
            const float *lr = llama_get_logits_ith(ctx, -1);
            if (!lr) die("llama_get_logits_ith(-1) returned NULL at decode step %d", s);
            row.assign(lr, lr + n_vocab);
        }
        w.tensor(std::string(pre) + "logits", {1, uint64_t(n_vocab)}, row.data(), p, "decode");
        auto [tok, m] = argmax(row.data(), n_vocab, std::string(pre) + "logits");
        step_tok.push_back(tok), step_margin.push_back(m);
        seq.push_back(llama_token(tok));
    }

    uint64_t shape_n[1] = {N};
    if (tg_decision(w.w, "logits.argmax", shape_n, 1, am.data(), n, margins.data(), n) != TG_OK)
        die("writing logits.argmax: %s", tg_last_error());
    for (int s = 0; s < a.generate; s++) {
        char name[32];
        std::snprintf(name, sizeof name, "decode.%04d.argmax", s);
        uint64_t one[1] = {1};
        if (tg_decision(w.w, name, one, 1, &step_tok[s], 1, &step_margin[s], 1) != TG_OK)
            die("writing %s: %s", name, tg_last_error());
    }
    char digest[65];
    g_open = nullptr;  // tg_close frees the writer whatever it returns
    if (tg_close(w.w, digest, sizeof digest) != TG_OK) die("%s", tg_last_error());
    std::printf("%s %s\n", digest, a.out.c_str());
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
