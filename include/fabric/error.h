// The one error type of the library: a code plus a message that says what was wrong and what to do.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

namespace fabric {

enum class ErrorCode {
  kOk = 0,
  kInvalidArgument,   // caller passed something that can never work (bad length, wrong NIC count)
  kOutOfBounds,       // offset/length outside a registered region
  kNotFound,          // unknown or deregistered handle, unknown peer group
  kMalformed,         // bytes from outside the process did not parse
  kProvider,          // the transport (libfabric, verbs) reported an error
  kTimeout,           // a transfer did not complete within the configured time (peer dead?)
  kShutdown,          // the engine was stopped before the transfer finished
  kResourceExhausted, // a queue or pool is full
  kUnsupported,       // the provider or build cannot do this
  kCancelled,         // the application ended it (cancel_imm_expectation, remove_peer)
};

std::string_view to_string(ErrorCode code);

// Outcome of an asynchronous operation, handed to completion callbacks.
class Status {
 public:
  Status() = default;
  Status(ErrorCode code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status ok_status() { return {}; }

  bool ok() const { return code_ == ErrorCode::kOk; }
  ErrorCode code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  ErrorCode code_ = ErrorCode::kOk;
  std::string message_;
};

// Thrown for every error found synchronously (at submit time, registration, parsing).
class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message)
      : std::runtime_error(std::string(to_string(code)) + ": " + message), code_(code) {}
  ErrorCode code() const { return code_; }
  Status status() const { return {code_, what()}; }

 private:
  ErrorCode code_;
};

}  // namespace fabric
