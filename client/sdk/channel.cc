#include "client/sdk/channel.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <climits>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/sdk/status.h"

namespace mha::client {
namespace {

absl::StatusOr<std::string> ReadPem(const std::string& path, absl::string_view flag) {
  std::ifstream file(path, std::ios::binary);
  std::stringstream text;
  if (file) text << file.rdbuf();
  if (!file || text.str().empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, ": cannot read ", path));
  }
  return text.str();
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> Credentials(
    const ChannelOptions& options) {
  if (options.tls_cert.empty() != options.tls_key.empty()) {
    return UsageError("--tls_cert and --tls_key go together (mutual TLS)");
  }
  if (!options.tls && options.tls_ca.empty() && options.tls_cert.empty()) {
    return grpc::InsecureChannelCredentials();
  }
  grpc::SslCredentialsOptions ssl;
  if (!options.tls_ca.empty()) {
    MHA_ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadPem(options.tls_ca, "tls_ca"));
  }
  if (!options.tls_cert.empty()) {
    MHA_ASSIGN_OR_RETURN(ssl.pem_cert_chain, ReadPem(options.tls_cert, "tls_cert"));
    MHA_ASSIGN_OR_RETURN(ssl.pem_private_key, ReadPem(options.tls_key, "tls_key"));
  }
  return grpc::SslCredentials(ssl);
}

// "host:port" or "[v6]:port" -> (host, port).
absl::StatusOr<std::pair<std::string, std::string>> SplitHostPort(const std::string& entry) {
  std::string host, port;
  if (!entry.empty() && entry[0] == '[') {
    const size_t close = entry.find(']');
    if (close == std::string::npos || close + 1 >= entry.size() || entry[close + 1] != ':') {
      return UsageError(absl::StrCat("--targets: expected [v6]:port, got ", entry));
    }
    host = entry.substr(1, close - 1);
    port = entry.substr(close + 2);
  } else {
    const size_t colon = entry.rfind(':');
    if (colon == std::string::npos || entry.find(':') != colon) {
      return UsageError(absl::StrCat("--targets: expected host:port, got ", entry));
    }
    host = entry.substr(0, colon);
    port = entry.substr(colon + 1);
  }
  int port_number = 0;
  if (host.empty() || !absl::SimpleAtoi(port, &port_number) || port_number < 1 ||
      port_number > 65535) {
    return UsageError(absl::StrCat("--targets: expected host:port, got ", entry));
  }
  return std::pair{host, port};
}

}  // namespace

std::string ProtocolName(Protocol protocol) {
  switch (protocol) {
    case Protocol::kKServe:
      return "kserve";
    case Protocol::kHttp:
      return "http";
    default:
      return "attention";
  }
}

absl::StatusOr<Protocol> ParseProtocol(absl::string_view name) {
  for (Protocol p : {Protocol::kAttention, Protocol::kKServe, Protocol::kHttp}) {
    if (name == ProtocolName(p)) return p;
  }
  return UsageError(
      absl::StrCat("--protocol: expected attention, kserve or http, got \"", name, "\""));
}

absl::StatusOr<std::string> RoundRobinTarget(const std::vector<std::string>& targets) {
  if (targets.empty()) return UsageError("--targets: empty");
  std::vector<std::string> addresses;
  int family = AF_UNSPEC;
  for (const std::string& entry : targets) {
    MHA_ASSIGN_OR_RETURN(auto host_port, SplitHostPort(entry));
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    addrinfo* found = nullptr;
    const int error =
        getaddrinfo(host_port.first.c_str(), host_port.second.c_str(), &hints, &found);
    if (error != 0 || found == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("--targets: cannot resolve ", entry, ": ", gai_strerror(error)));
    }
    char text[INET6_ADDRSTRLEN] = {};
    const int entry_family = found->ai_family;
    const void* address =
        entry_family == AF_INET
            ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(found->ai_addr)->sin_addr)
            : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(found->ai_addr)->sin6_addr);
    inet_ntop(entry_family, address, text, sizeof(text));
    freeaddrinfo(found);
    if (family != AF_UNSPEC && family != entry_family) {
      return UsageError(
          "--targets: mixes IPv4 and IPv6 addresses; gRPC's ipv4:/ipv6: targets take one family");
    }
    family = entry_family;
    addresses.push_back(entry_family == AF_INET ? absl::StrCat(text, ":", host_port.second)
                                                : absl::StrCat("[", text, "]:", host_port.second));
  }
  return absl::StrCat(family == AF_INET ? "ipv4:" : "ipv6:", absl::StrJoin(addresses, ","));
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(const ChannelOptions& options,
                                                           int index) {
  MHA_ASSIGN_OR_RETURN(auto credentials, Credentials(options));
  grpc::ChannelArguments args;
  const int max_bytes =
      options.max_message_bytes < 0
          ? -1
          : static_cast<int>(std::min<int64_t>(options.max_message_bytes, INT_MAX));
  args.SetMaxReceiveMessageSize(max_bytes);
  args.SetMaxSendMessageSize(max_bytes);
  if (!options.tls_server_name.empty()) args.SetSslTargetNameOverride(options.tls_server_name);
  // Channels with equal arguments share connections; a distinct pool per index does not.
  if (index > 0) args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  std::string target = options.target;
  if (!options.targets.empty()) {
    MHA_ASSIGN_OR_RETURN(target, RoundRobinTarget(options.targets));
    args.SetServiceConfigJSON(R"({"loadBalancingConfig": [{"round_robin": {}}]})");
  }
  return grpc::CreateCustomChannel(target, credentials, args);
}

absl::Status WithChannelHint(const absl::Status& status, const ChannelOptions& options) {
  const absl::string_view message = status.message();
  const bool tls = options.tls || !options.tls_ca.empty() || !options.tls_cert.empty();
  std::string hint;
  if (status.code() == absl::StatusCode::kUnavailable && options.protocol != Protocol::kHttp) {
    if (!tls && absl::StrContains(message, "Socket closed")) {
      hint = "the server may speak TLS, this client plaintext: give --tls or --tls_ca";
    } else if (tls && options.tls_cert.empty() && absl::StrContains(message, "Socket closed")) {
      // A mutual-TLS server ends the handshake of a client without a certificate.
      hint = "the server may require a client certificate (mutual TLS): give --tls_cert and "
             "--tls_key";
    } else if (tls && absl::StrContains(message, "wrong version number")) {
      hint = "the server may speak plaintext, this client TLS: drop the --tls flags";
    } else if (tls && absl::StrContains(message, "certificate verify failed")) {
      hint = "the client does not trust the server's certificate: give its CA with --tls_ca";
    }
  }
  // gRPC's "Sent message larger than max (X vs. Y)" or "Received ...": Y is the limit.
  int64_t limit = 0;
  const size_t vs = message.find(" vs. ");
  if (status.code() == absl::StatusCode::kResourceExhausted &&
      absl::StrContains(message, "message larger than max") && vs != absl::string_view::npos &&
      absl::SimpleAtoi(message.substr(vs + 5, message.find(')', vs) - vs - 5), &limit)) {
    hint = limit == options.max_message_bytes
               ? absl::StrCat("the client's limit, --max_message_size=", limit, ": raise it")
               : absl::StrCat("the server's limit, ", limit,
                              " bytes: attention_server --max_request_bytes, or the model's");
  }
  if (hint.empty()) return status;
  return absl::Status(status.code(), absl::StrCat(message, " (", hint, ")"));
}

void SetTimeout(grpc::ClientContext* context, absl::Duration timeout) {
  context->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
}

}  // namespace mha::client
