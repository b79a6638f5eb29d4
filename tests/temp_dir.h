// A fresh temporary directory for a test, removed with everything in it by the
// destructor. Not thread-safe; one owner.
#ifndef MHA_TESTS_TEMP_DIR_H_
#define MHA_TESTS_TEMP_DIR_H_

#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace mha::testing {

class TempDir {
 public:
  TempDir() {
    std::string pattern =
        (std::filesystem::temp_directory_path() / "mha_server_test.XXXXXX").string();
    path_ = mkdtemp(pattern.data());
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }

  // Writes `contents` to path()/relative, creating directories; returns its path.
  std::string Write(const std::string& relative, const std::string& contents) const {
    const std::filesystem::path path = std::filesystem::path(path_) / relative;
    std::filesystem::create_directories(path.parent_path());
    std::ofstream(path, std::ios::binary) << contents;
    return path.string();
  }

 private:
  std::string path_;
};

}  // namespace mha::testing

#endif  // MHA_TESTS_TEMP_DIR_H_
