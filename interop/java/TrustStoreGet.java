import java.net.InetSocketAddress;
import java.net.ProxySelector;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;

/** GET args[1] through the proxy at 127.0.0.1:args[0] with the JVM's default trust (the
 *  store javax.net.ssl.trustStore names) and print the body. Run by tests/tls.rs. */
public class TrustStoreGet {
    public static void main(String[] args) throws Exception {
        HttpClient client = HttpClient.newBuilder()
                .proxy(ProxySelector.of(new InetSocketAddress("127.0.0.1", Integer.parseInt(args[0]))))
                .build();
        HttpResponse<String> r = client.send(HttpRequest.newBuilder(URI.create(args[1])).build(),
                HttpResponse.BodyHandlers.ofString());
        System.out.print(r.statusCode() + " " + r.body());
    }
}
