// One JSON object per line, the microbenchmark's output format: numbers, strings, booleans
// and flat arrays of numbers, keys in the order they were added. Host code only (no CUDA), so
// a test builds it with the host compiler and reads its lines back with a JSON parser.
#pragma once
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace hybrid_ep::micro {

// `text` as a JSON string literal, quotes included.
inline std::string json_quote(const std::string& text) {
  std::string out = "\"";
  for (unsigned char ch : text) {
    switch (ch) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (ch < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", ch);
          out += buf;
        } else {
          out += static_cast<char>(ch);
        }
    }
  }
  return out + "\"";
}

// A number as JSON: nine significant digits; NaN and infinities (a division by a zero span)
// become null, which JSON can carry and Python reads as None.
inline std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.9g", v);
  return buf;
}

class JsonLine {
 public:
  JsonLine& add(const char* key, const std::string& v) { return raw(key, json_quote(v)); }
  JsonLine& add(const char* key, const char* v) { return raw(key, json_quote(v)); }
  JsonLine& add(const char* key, bool v) { return raw(key, v ? "true" : "false"); }
  JsonLine& add(const char* key, double v) { return raw(key, json_number(v)); }
  JsonLine& add(const char* key, int v) { return add(key, static_cast<int64_t>(v)); }
  JsonLine& add(const char* key, unsigned v) { return add(key, static_cast<uint64_t>(v)); }
  JsonLine& add(const char* key, int64_t v) {
    char buf[24];
    std::snprintf(buf, sizeof(buf), "%" PRId64, v);
    return raw(key, buf);
  }
  JsonLine& add(const char* key, uint64_t v) {
    char buf[24];
    std::snprintf(buf, sizeof(buf), "%" PRIu64, v);
    return raw(key, buf);
  }
  JsonLine& add(const char* key, const std::vector<double>& v) {
    std::string list = "[";
    for (size_t i = 0; i < v.size(); ++i) list += (i ? "," : "") + json_number(v[i]);
    return raw(key, list + "]");
  }

  std::string str() const { return "{" + body_ + "}"; }
  // Writes the line and flushes, so a run cut short keeps every line it finished.
  void print(std::FILE* out = stdout) const {
    std::fprintf(out, "%s\n", str().c_str());
    std::fflush(out);
  }

 private:
  JsonLine& raw(const char* key, const std::string& value) {
    if (!body_.empty()) body_ += ",";
    body_ += json_quote(key) + ":" + value;
    return *this;
  }
  std::string body_;
};

}  // namespace hybrid_ep::micro
