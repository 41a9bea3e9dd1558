// The native kernels as PyTorch operators (namespace "hydraspec"), so that torch.compile can put them in
// one graph with the stock model code around them (hydraspec/cpu/graph.py). Each operator calls the same
// C function of the kernel library that the eager path calls through ctypes, with the same arguments, so
// a compiled step computes the same bits as an eager one. The library's functions are handed over once
// (bind) as addresses; this file needs no link to it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <stdexcept>

namespace {

typedef int (*gguf_apply_fn)(const void*, int64_t, const void*, void*, int);
typedef void (*gguf_rows_fn)(const void*, const int64_t*, int64_t, void*);
typedef int (*attention_fn)(const void*, const int64_t*, const void*, const int64_t*, const void*, const int64_t*,
                            const void*, const int64_t*, int, int, int64_t, int64_t, int64_t, int64_t, int64_t,
                            int64_t, int64_t, float, void*, int);
typedef int (*rmsnorm_fn)(const void*, const void*, int64_t, int64_t, float, int, void*, int);
typedef int (*rope_fn)(const void*, void*, const void*, void*, const void*, const void*, const int64_t*);
typedef int (*silu_mul_fn)(const void*, int64_t, const void*, int64_t, int64_t, int64_t, void*, int);
typedef int (*w4a8_fn)(const void*, int64_t, int64_t, const void*, const float*, int64_t, int64_t, void*, const float*,
                       int);

gguf_apply_fn g_gguf_apply = nullptr;
gguf_rows_fn g_gguf_rows = nullptr;
attention_fn g_attention = nullptr;
rmsnorm_fn g_rmsnorm = nullptr;
rope_fn g_rope = nullptr;
silu_mul_fn g_silu_mul = nullptr;
w4a8_fn g_w4a8 = nullptr;

template <typename F>
F need(F f, const char* name) {
    if (f == nullptr) throw std::runtime_error(std::string("hydraspec op ") + name + ": kernels not bound");
    return f;
}

void check(int err, const char* name) {
    if (err) throw std::runtime_error(std::string("hydraspec op ") + name + ": out of memory");
}

int threads() { return at::get_num_threads(); }

at::Tensor last_unit(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

void bind(at::IntArrayRef fns) {
    if (fns.size() != 7) throw std::runtime_error("hydraspec bind: seven kernel addresses expected");
    g_gguf_apply = reinterpret_cast<gguf_apply_fn>(fns[0]);
    g_gguf_rows = reinterpret_cast<gguf_rows_fn>(fns[1]);
    g_attention = reinterpret_cast<attention_fn>(fns[2]);
    g_rmsnorm = reinterpret_cast<rmsnorm_fn>(fns[3]);
    g_rope = reinterpret_cast<rope_fn>(fns[4]);
    g_silu_mul = reinterpret_cast<silu_mul_fn>(fns[5]);
    g_w4a8 = reinterpret_cast<w4a8_fn>(fns[6]);
}

// x [..., in] bf16 times a GGUF weight whose gguf_call fields (hs_gguf.h) are the int64 tensor `call`
// the rows of x [..., in] made contiguous, and an output [..., out] for them
struct Rows {
    at::Tensor x, y;
    int64_t n, in;
    Rows(const at::Tensor& x_, int64_t out) : x(x_.contiguous()) {
        auto sizes = x.sizes().vec();
        in = sizes.back();
        sizes.back() = out;
        y = at::empty(sizes, x.options());
        n = in ? x.numel() / in : 0;
    }
};

at::Tensor gguf_linear(const at::Tensor& x_, const at::Tensor& call, int64_t out) {
    Rows r(x_, out);
    const at::Tensor &x = r.x, &y = r.y;
    const int64_t rows = r.n;
    check(need(g_gguf_apply, "gguf_linear")(x.data_ptr(), rows, call.data_ptr(), y.data_ptr(), threads()),
          "gguf_linear");
    return y;
}

// x [..., in] bf16 times a w4a8 draft weight (hydraspec/cpu/kernels.py's W4A8Linear: packed 4-bit codes,
// one fp32 scale per row and group of `group` inputs, fp32 bias or none)
at::Tensor w4a8_linear(const at::Tensor& x_, const at::Tensor& qweight, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias, int64_t group, int64_t out) {
    Rows r(x_, out);
    const at::Tensor &x = r.x, &y = r.y;
    const int64_t rows = r.n, in = r.in;
    const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
    check(need(g_w4a8, "w4a8_linear")(x.data_ptr(), rows, in, qweight.data_ptr(), scale.data_ptr<float>(), group, out,
                                      y.data_ptr(), b, threads()),
          "w4a8_linear");
    return y;
}

// rows `ids` of a GGUF table, dequantized to bf16: [..., dim]
at::Tensor gguf_rows(const at::Tensor& ids_, const at::Tensor& call, int64_t dim) {
    at::Tensor ids = ids_.to(at::kLong).contiguous();
    auto sizes = ids.sizes().vec();
    sizes.push_back(dim);
    at::Tensor y = at::empty(sizes, ids.options().dtype(at::kBFloat16));
    need(g_gguf_rows, "gguf_rows")(call.data_ptr(), ids.data_ptr<int64_t>(), ids.numel(), y.data_ptr());
    return y;
}

// query [B, H, n, d], key / value [B, Hkv, L, d(v)], mask None or [B|1, 1, n, >=L] bool / additive of q's
// dtype -> [B, n, H, dv] (hydraspec/cpu/attention.py's _native, whose checks the caller has made)
at::Tensor attention(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
                     const std::optional<at::Tensor>& mask_, double scale) {
    at::Tensor q = last_unit(q_), k = last_unit(k_), v = last_unit(v_);
    const int64_t b = q.size(0), h = q.size(1), n = q.size(2), d = q.size(3);
    const int64_t hkv = k.size(1), L = k.size(2), dv = v.size(3);
    int64_t qs[3] = {q.stride(0), q.stride(1), q.stride(2)}, ks[3] = {k.stride(0), k.stride(1), k.stride(2)},
            vs[3] = {v.stride(0), v.stride(1), v.stride(2)}, ms[3] = {0, 0, 0};
    int mkind = 0;
    const void* mp = nullptr;
    at::Tensor m;
    if (mask_.has_value()) {
        m = last_unit(*mask_);
        mkind = m.scalar_type() == at::kBool ? 1 : (m.scalar_type() == at::kFloat ? 2 : 3);
        mp = m.data_ptr();
        ms[0] = m.size(0) > 1 ? m.stride(0) : 0;
        ms[1] = m.stride(2);
    }
    at::Tensor out = at::empty({b, n, h, dv}, q.options());
    check(need(g_attention, "attention")(q.data_ptr(), qs, k.data_ptr(), ks, v.data_ptr(), vs, mp, ms, mkind,
                                         q.scalar_type() == at::kBFloat16, b, h, hkv, n, L, d, dv, (float)scale,
                                         out.data_ptr(), threads()),
          "attention");
    return out;
}

at::Tensor rmsnorm(const at::Tensor& x_, const at::Tensor& w, double eps) {
    at::Tensor x = x_.contiguous();
    at::Tensor y = at::empty_like(x);
    const int64_t dim = x.size(-1);
    check(need(g_rmsnorm, "rmsnorm")(x.data_ptr(), w.data_ptr(), dim ? x.numel() / dim : 0, dim, (float)eps,
                                     x.scalar_type() == at::kBFloat16, y.data_ptr(), threads()),
          "rmsnorm");
    return y;
}

// the rotate-half rotary embedding of bf16 q [B, Hq, N, D] and k [B, Hk, N, D] with cos / sin [B|1, N, D]
std::tuple<at::Tensor, at::Tensor> rope(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& cos_,
                                        const at::Tensor& sin_) {
    at::Tensor q = last_unit(q_), k = last_unit(k_), cos = last_unit(cos_);
    at::Tensor sin = sin_;
    if (sin.strides() != cos.strides()) {
        sin = at::empty_strided(cos.sizes(), cos.strides(), cos.options());
        sin.copy_(sin_);
    }
    at::Tensor qo = at::empty_like(q), ko = at::empty_like(k);
    int64_t dims[19] = {q.size(0), q.size(2), q.size(3), q.size(1), k.size(1),
                        q.stride(0), q.stride(1), q.stride(2), qo.stride(0), qo.stride(1), qo.stride(2),
                        k.stride(0), k.stride(1), k.stride(2), ko.stride(0), ko.stride(1), ko.stride(2),
                        cos.size(0) > 1 ? cos.stride(0) : 0, cos.stride(1)};
    check(need(g_rope, "rope")(q.data_ptr(), qo.data_ptr(), k.data_ptr(), ko.data_ptr(), cos.data_ptr(),
                               sin.data_ptr(), dims),
          "rope");
    return {qo, ko};
}

// silu(g) * u of bf16 [..., I] tensors whose rows lie at a fixed stride (e.g. the two halves of one
// joined gate/up output) -> [..., I] contiguous
at::Tensor silu_mul(const at::Tensor& g_, const at::Tensor& u_) {
    auto rows_even = [](const at::Tensor& t) {  // rows [n, I] at one stride, last stride 1
        if (t.stride(-1) != 1) return t.contiguous();
        for (int64_t i = t.dim() - 2; i >= 1; --i) {
            if (t.stride(i - 1) != t.size(i) * t.stride(i)) return t.contiguous();
        }
        return t;
    };
    at::Tensor g = rows_even(g_), u = rows_even(u_);
    const int64_t inter = g.size(-1), n = inter ? g.numel() / inter : 0;
    const int64_t gs = g.dim() >= 2 ? g.stride(-2) : inter, us = u.dim() >= 2 ? u.stride(-2) : inter;
    at::Tensor h = at::empty(g.sizes(), g.options().memory_format(at::MemoryFormat::Contiguous));
    check(need(g_silu_mul, "silu_mul")(g.data_ptr(), gs, u.data_ptr(), us, n, inter, h.data_ptr(), threads()),
          "silu_mul");
    return h;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hydraspec, m) {
    m.def("bind(int[] fns) -> ()");
    m.def("gguf_linear(Tensor x, Tensor call, int out) -> Tensor");
    m.def("gguf_rows(Tensor ids, Tensor call, int dim) -> Tensor");
    m.def("w4a8_linear(Tensor x, Tensor qweight, Tensor scale, Tensor? bias, int group, int out) -> Tensor");
    m.def("attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
    m.def("rmsnorm(Tensor x, Tensor w, float eps) -> Tensor");
    m.def("rope(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
    m.def("silu_mul(Tensor g, Tensor u) -> Tensor");
}

TORCH_LIBRARY_IMPL(hydraspec, CompositeExplicitAutograd, m) {
    m.impl("bind", bind);
}

TORCH_LIBRARY_IMPL(hydraspec, CPU, m) {
    m.impl("gguf_linear", gguf_linear);
    m.impl("gguf_rows", gguf_rows);
    m.impl("w4a8_linear", w4a8_linear);
    m.impl("attention", attention);
    m.impl("rmsnorm", rmsnorm);
    m.impl("rope", rope);
    m.impl("silu_mul", silu_mul);
}
