// Parses the Prometheus text format 0.0.4 as a scraper would, failing the test on anything a
// scraper would refuse: a sample before its family's TYPE, a second TYPE for one family, a
// family's samples not together, a bad label quoting. Series are keyed "name{a="x",b="y"}" with
// the labels sorted and values unescaped.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace fabric::testing {

struct Exposition {
  std::map<std::string, double> series;
  std::map<std::string, std::string> types;  // family -> type
  double get(const std::string& key) const {
    auto it = series.find(key);
    EXPECT_NE(it, series.end()) << "no series " << key;
    return it == series.end() ? -1 : it->second;
  }
  bool has(const std::string& key) const { return series.count(key) > 0; }
  // Sum of every series of `name` whose labels include all of `match` (name="value" pieces).
  double sum(const std::string& name, const std::vector<std::string>& match = {}) const {
    double total = 0;
    for (const auto& [k, v] : series) {
      if (k.compare(0, name.size(), name) != 0 || (k.size() > name.size() && k[name.size()] != '{')) continue;
      bool ok = true;
      for (const auto& m : match) ok &= k.find(m) != std::string::npos;
      if (ok) total += v;
    }
    return total;
  }
};

inline Exposition parse_exposition(const std::string& text) {
  Exposition e;
  std::istringstream in(text);
  std::string line, current;
  std::set<std::string> closed;  // families whose samples are over
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    if (line.rfind("# TYPE ", 0) == 0) {
      std::istringstream l(line.substr(7));
      std::string name, type;
      l >> name >> type;
      EXPECT_EQ(e.types.count(name), 0u) << "second TYPE line for " << name;
      e.types[name] = type;
      if (!current.empty()) closed.insert(current);
      current = name;
      continue;
    }
    if (line[0] == '#') continue;  // HELP
    size_t i = 0;
    while (i < line.size() && line[i] != '{' && line[i] != ' ') i++;
    const std::string name = line.substr(0, i);
    std::vector<std::pair<std::string, std::string>> labels;
    if (i < line.size() && line[i] == '{') {
      i++;
      while (line[i] != '}') {
        size_t eq = line.find('=', i);
        std::string lname = line.substr(i, eq - i);
        EXPECT_EQ(line[eq + 1], '"') << line;
        std::string value;
        size_t j = eq + 2;
        for (; j < line.size() && line[j] != '"'; j++) {
          if (line[j] == '\\') {
            j++;
            value += line[j] == 'n' ? '\n' : line[j];
          } else {
            value += line[j];
          }
        }
        labels.emplace_back(lname, value);
        i = j + 1;
        if (line[i] == ',') i++;
      }
      i++;
    }
    EXPECT_EQ(line[i], ' ') << line;
    const double value = std::stod(line.substr(i + 1));
    std::string family = name;
    for (const char* suffix : {"_bucket", "_sum", "_count"}) {
      const std::string s = suffix;
      if (name.size() > s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0 &&
          e.types.count(name.substr(0, name.size() - s.size())) &&
          e.types[name.substr(0, name.size() - s.size())] == "histogram")
        family = name.substr(0, name.size() - s.size());
    }
    EXPECT_EQ(family, current) << "sample " << name << " outside its family's block";
    EXPECT_EQ(closed.count(family), 0u) << family << "'s samples are split";
    std::sort(labels.begin(), labels.end());
    std::string key = name;
    if (!labels.empty()) {
      key += '{';
      for (size_t k = 0; k < labels.size(); k++)
        key += (k ? "," : "") + labels[k].first + "=\"" + labels[k].second + "\"";
      key += '}';
    }
    EXPECT_EQ(e.series.count(key), 0u) << "duplicate series " << key;
    e.series[key] = value;
  }
  return e;
}

}  // namespace fabric::testing
