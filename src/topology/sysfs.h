// Reading a sysfs tree under a root directory: the live /sys, or a recorded fixture materialised in
// a temporary directory. Paths are relative to the root ("bus/pci/devices/0000:53:00.0/class").
// Symlinks are resolved component by component inside the root, as if the root were "/": a
// relative target is taken from the link's directory, ".." never climbs above the root, and an
// absolute target is followed only when it points inside the root. Nothing here throws: a missing
// file, directory or link gives an empty optional (or an empty list).
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace fabric::topo {

class SysfsTree {
 public:
  explicit SysfsTree(std::string root);

  const std::string& root() const { return root_; }

  // The file's contents, trailing whitespace (the newline sysfs ends every value with) removed.
  std::optional<std::string> read(std::string_view path) const;
  // read() parsed as a decimal integer ("-1", "0\n"); empty when absent or not a number.
  std::optional<long> read_int(std::string_view path) const;
  // The target of the symlink at `path`, as stored (its parents resolved, the link itself not).
  std::optional<std::string> link_target(std::string_view path) const;
  // `path` with every symlink resolved, relative to the root ("devices/pci0000:44/..."), when it
  // exists.
  std::optional<std::string> resolve(std::string_view path) const;
  // The names in a directory, sorted; empty when it does not exist.
  std::vector<std::string> list(std::string_view path) const;
  bool is_dir(std::string_view path) const;

 private:
  // Resolves every component; with follow_last false, the last one is taken as it is.
  std::optional<std::vector<std::string>> walk(std::string_view path, bool follow_last) const;
  std::string absolute(const std::vector<std::string>& parts) const;

  std::string root_;
  std::string canonical_root_;  // root_ with its own symlinks resolved: where absolute links point
};

// Splits "a/b//c/" into {"a", "b", "c"}.
std::vector<std::string> split_path(std::string_view path);

}  // namespace fabric::topo
